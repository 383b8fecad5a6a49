#!/usr/bin/env bash
# Copy the alert rules and the Grafana dashboard into the Helm chart (Helm reads files only
# from inside the chart). tests/unit/test_helm_chart.py fails when the copies differ.
set -euo pipefail
cd "$(dirname "$0")/.."
cp alerts/rules/loopwatch.rules.yml deploy/helm/loopwatch/files/loopwatch.rules.yml
cp alerts/grafana/dashboards/loopwatch.json deploy/helm/loopwatch/files/loopwatch.json
echo "chart files synced from alerts/"
