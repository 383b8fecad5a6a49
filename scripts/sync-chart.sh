#!/usr/bin/env bash
# Copy the alert rules and the Grafana dashboard into the Helm chart (Helm reads files only
# from inside the chart), and write the Alertmanager routing as a kube-prometheus-stack
# values snippet. tests/unit/deploy/test_helm_chart.py fails when any of them differs.
set -euo pipefail
cd "$(dirname "$0")/.."
cp alerts/rules/loopwatch.rules.yml deploy/helm/loopwatch/files/loopwatch.rules.yml
cp alerts/grafana/dashboards/loopwatch.json deploy/helm/loopwatch/files/loopwatch.json
PY=.venv/bin/python
[[ -x "$PY" ]] || PY=python3
"$PY" - <<'PYEOF'
import yaml

config = yaml.safe_load(open("alerts/alertmanager/alertmanager.yml"))
head = (
    "# loopwatch's Alertmanager routing as kube-prometheus-stack values (alertmanager.config),\n"
    "# written by scripts/sync-chart.sh from alerts/alertmanager/alertmanager.yml (a test keeps\n"
    "# them equal). REPLACE the two webhook URLs with your pager and ticket endpoints;\n"
    "# merge the route into yours if Alertmanager already routes other teams' alerts.\n"
)
with open("deploy/helm/alertmanager-values.yaml", "w") as out:
    out.write(head)
    yaml.safe_dump({"alertmanager": {"config": config}}, out, sort_keys=False)
PYEOF
echo "chart files synced from alerts/"
