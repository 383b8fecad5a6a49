{{- define "loopwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loopwatch.fullname" -}}
{{- if contains (include "loopwatch.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "loopwatch.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "loopwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loopwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loopwatch.labels" -}}
{{ include "loopwatch.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "loopwatch.secretName" -}}
{{- default (printf "%s-secret" (include "loopwatch.fullname" .)) .Values.secret.existingSecret -}}
{{- end -}}

{{/* Checks the values cannot express: fail the render with the fix. */}}
{{- define "loopwatch.checks" -}}
{{- if not .Values.kafka.bootstrap -}}
{{- fail "kafka.bootstrap is required: the Kafka bootstrap servers (host:port[,host:port])" -}}
{{- end -}}
{{- if gt (int .Values.replicas) (int .Values.kafka.partitions) -}}
{{- fail (printf "replicas (%d) > kafka.partitions (%d): a worker without a partition idles; lower replicas or raise partitions" (int .Values.replicas) (int .Values.kafka.partitions)) -}}
{{- end -}}
{{- if and .Values.keda.enabled (gt (int .Values.keda.maxReplicas) (int .Values.kafka.partitions)) -}}
{{- fail (printf "keda.maxReplicas (%d) > kafka.partitions (%d): replicas past the partitions idle" (int .Values.keda.maxReplicas) (int .Values.kafka.partitions)) -}}
{{- end -}}
{{- end -}}
