{{/* Names: at most 40 characters, so "<fullname>-prefill-<ordinal>" stays a valid pod name. */}}
{{- define "proserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "proserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "prefill"). */}}
{{- define "proserve.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The worker's --device for .Values.accelerator. */}}
{{- define "proserve.device" -}}
{{- $a := .Values.accelerator -}}
{{- if eq $a "cpu" }}cpu{{ else if eq $a "cuda" }}cuda{{ else if eq $a "ascend" }}npu{{ else -}}
{{- fail (printf "accelerator must be cpu, cuda or ascend, got %q" $a) -}}
{{- end -}}
{{- end -}}

{{/* The extended resource a worker requests for .Values.accelerator (empty for cpu). */}}
{{- define "proserve.acceleratorResource" -}}
{{- if eq .Values.accelerator "cuda" }}nvidia.com/gpu{{ else if eq .Values.accelerator "ascend" }}huawei.com/Ascend910{{ end -}}
{{- end -}}

{{/* Stable DNS name of one worker pod; call with (dict "root" $ "role" "prefill" "i" 0). */}}
{{- define "proserve.podHost" -}}
{{- $name := printf "%s-%s" (include "proserve.fullname" .root) .role -}}
{{- printf "%s-%d.%s.%s.svc.%s" $name (int .i) $name .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* The address a process binds: its pod IP ($(POD_IP), set from the downward API) or 0.0.0.0. */}}
{{- define "proserve.bind" -}}
{{- if .Values.bindPodIP }}$(POD_IP){{ else }}0.0.0.0{{ end -}}
{{- end -}}

{{- define "proserve.podIPEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* Prometheus scrape annotations; call with (dict "root" $ "port" 8000). */}}
{{- define "proserve.scrapeAnnotations" -}}
{{- if .root.Values.prometheus.annotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{- define "proserve.latencyModelPath" -}}
{{- if .Values.latencyModel.configMap -}}
/etc/proserve/latency-model/{{ .Values.latencyModel.key }}
{{- end -}}
{{- end -}}
