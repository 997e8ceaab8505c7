{{/*
The chart's name, overridable with nameOverride.
*/}}
{{- define "hvd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: object names start with it, cut to the 63 characters a label value allows.
*/}}
{{- define "hvd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version for the helm.sh/chart label.
*/}}
{{- define "hvd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels every object of the release carries, but its component.
*/}}
{{- define "hvd.commonLabels" -}}
helm.sh/chart: {{ include "hvd.chart" . }}
{{ include "hvd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels of the operator's objects: the common ones, the component the operator.
*/}}
{{- define "hvd.labels" -}}
{{ include "hvd.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Labels that select the operator's pods; they never change across upgrades.
*/}}
{{- define "hvd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hvd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the operator runs as.
*/}}
{{- define "hvd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hvd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image, its tag defaulting to the chart's appVersion.
*/}}
{{- define "hvd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The Lease the operator replicas compete for.
*/}}
{{- define "hvd.leaseName" -}}
{{- default (include "hvd.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
Whether the operator elects a leader. Two replicas without election would both reconcile every
job, so that combination stops the install with a message naming both values.
*/}}
{{- define "hvd.leaderElection" -}}
{{- if .Values.leaderElection.enabled }}true
{{- else if gt (int .Values.replicas) 1 }}
{{- fail (printf "replicas is %d but leaderElection.enabled is false: more than one operator replica needs leader election" (int .Values.replicas)) }}
{{- end }}
{{- end }}
