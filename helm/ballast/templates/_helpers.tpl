{{/*
Names, labels and the pieces of pod specs that several templates share.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "ballast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name: fullnameOverride, or <release>-<chart> (just <release> when it already holds the chart name). */}}
{{- define "ballast.fullname" -}}
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

{{/* <chart>-<version> for the helm.sh/chart label. */}}
{{- define "ballast.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the pods of one release. */}}
{{- define "ballast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ballast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "ballast.labels" -}}
helm.sh/chart: {{ include "ballast.chart" . }}
{{ include "ballast.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ballast
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "api"). */}}
{{- define "ballast.componentLabels" -}}
{{ include "ballast.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Labels of the Ray pod templates: no helm.sh/chart, so that a new chart version alone does not change the RayCluster
spec (with upgradeStrategy Recreate, any spec change deletes every Ray pod); a new image tag does.
*/}}
{{- define "ballast.rayPodLabels" -}}
{{ include "ballast.selectorLabels" .ctx }}
app.kubernetes.io/version: {{ .ctx.Values.image.tag | default .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ballast
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Selector labels of one component: (dict "ctx" $ "component" "api"). */}}
{{- define "ballast.componentSelectorLabels" -}}
{{ include "ballast.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The image reference. */}}
{{- define "ballast.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The ServiceAccount the API, scheduler and Ray pods run as. */}}
{{- define "ballast.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ballast.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Component names. */}}
{{- define "ballast.apiName" -}}
{{- printf "%s-api" (include "ballast.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "ballast.schedulerName" -}}
{{- printf "%s-scheduler" (include "ballast.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "ballast.checkpointClaimName" -}}
{{- .Values.checkpoints.pvc.existingClaim | default (printf "%s-checkpoints" (include "ballast.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/*
The RayCluster's name, short enough that KubeRay's head Service "<name>-head-svc" is a valid 63-character name.
*/}}
{{- define "ballast.rayClusterName" -}}
{{- printf "%s-ray" (include "ballast.fullname" .) | trunc 54 | trimSuffix "-" }}
{{- end }}

{{/* True when the chart renders its own RayCluster. */}}
{{- define "ballast.rendersRayCluster" -}}
{{- if and (not .Values.ray.address) .Values.rayCluster.enabled }}true{{ end }}
{{- end }}

{{/*
RAY_ADDRESS for the API and the scheduler. Those pods are not Ray nodes (no raylet runs in them): a driver given
the GCS address (<head-svc>:6379) looks for a raylet on its own host and fails, so they connect through the Ray
Client server on the head, ray://<cluster>-head-svc:10001. KubeRay names the head Service "<cluster>-head-svc".
*/}}
{{- define "ballast.rayAddress" -}}
{{- if .Values.ray.address }}
{{- .Values.ray.address }}
{{- else if .Values.rayCluster.enabled }}
{{- printf "ray://%s-head-svc:%d" (include "ballast.rayClusterName" .) (int .Values.rayCluster.clientPort) }}
{{- else }}
{{- fail "set ray.address (an existing Ray cluster) or rayCluster.enabled=true (a KubeRay RayCluster)" }}
{{- end }}
{{- end }}

{{/* BALLAST_DATABASE_URL from the DSN Secret: the same in the API, the scheduler and the migration Job. */}}
{{- define "ballast.databaseEnv" -}}
- name: BALLAST_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "database.existingSecret is required: a Secret with the PostgreSQL URL" .Values.database.existingSecret }}
      key: {{ .Values.database.urlKey }}
{{- end }}

{{/* BALLAST_HOME on the writable emptyDir. */}}
{{- define "ballast.homeEnv" -}}
- name: BALLAST_HOME
  value: /home/ballast/.ballast
{{- end }}

{{/* The BALLAST_* settings of the config block that are set. */}}
{{- define "ballast.configEnv" -}}
{{- with .Values.config }}
{{- if not (kindIs "invalid" .maxConcurrentRuns) }}
- name: BALLAST_MAX_CONCURRENT_RUNS
  value: {{ .maxConcurrentRuns | quote }}
{{- end }}
{{- if not (kindIs "invalid" .schedulerPollSeconds) }}
- name: BALLAST_SCHEDULER_POLL_SECONDS
  value: {{ .schedulerPollSeconds | quote }}
{{- end }}
{{- if not (kindIs "invalid" .maxRecipeBytes) }}
- name: BALLAST_MAX_RECIPE_BYTES
  value: {{ .maxRecipeBytes | quote }}
{{- end }}
{{- if not (kindIs "invalid" .metricsEverySteps) }}
- name: BALLAST_METRICS_EVERY_STEPS
  value: {{ .metricsEverySteps | quote }}
{{- end }}
{{- if not (kindIs "invalid" .standbyWorkerGroups) }}
- name: BALLAST_STANDBY_WORKER_GROUPS
  value: {{ .standbyWorkerGroups | quote }}
{{- end }}
{{- if .allowedImportModules }}
- name: BALLAST_ALLOWED_IMPORT_MODULES
  value: {{ join "," .allowedImportModules | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* S3 credentials, region and endpoint: the scheduler (it deletes retired checkpoints) and every Ray pod. */}}
{{- define "ballast.s3Env" -}}
{{- if eq .Values.checkpoints.storage "s3" }}
{{- with .Values.checkpoints.s3 }}
{{- if .existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .secretAccessKeyKey }}
{{- end }}
{{- if .region }}
- name: AWS_DEFAULT_REGION
  value: {{ .region | quote }}
{{- end }}
{{- if .endpointUrl }}
- name: AWS_ENDPOINT_URL_S3
  value: {{ .endpointUrl | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* BALLAST_CHECKPOINT_ROOT of the scheduler: the S3 URI or the shared volume's mount path (declared shared). */}}
{{- define "ballast.checkpointRootEnv" -}}
- name: BALLAST_CHECKPOINT_ROOT
{{- if eq .Values.checkpoints.storage "s3" }}
  value: {{ required "checkpoints.s3.uri is required when checkpoints.storage is s3 (e.g. s3://bucket/prefix)" .Values.checkpoints.s3.uri | quote }}
{{- else if eq .Values.checkpoints.storage "pvc" }}
  value: {{ .Values.checkpoints.pvc.mountPath | quote }}
{{- /* the claim is mounted on every Ray pod: declare it shared, or a multi-node cluster refuses the local path */}}
- name: BALLAST_CHECKPOINT_ROOT_SHARED
  value: "true"
{{- else }}
{{- fail (printf "checkpoints.storage must be pvc or s3, not %q" .Values.checkpoints.storage) }}
{{- end }}
{{- end }}

{{/* The shared checkpoint volume and its mount (only with storage: pvc). */}}
{{- define "ballast.checkpointVolume" -}}
{{- if eq .Values.checkpoints.storage "pvc" }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "ballast.checkpointClaimName" . }}
{{- end }}
{{- end }}
{{- define "ballast.checkpointVolumeMount" -}}
{{- if eq .Values.checkpoints.storage "pvc" }}
- name: checkpoints
  mountPath: {{ .Values.checkpoints.pvc.mountPath }}
{{- end }}
{{- end }}

{{/* The writable directories of a read-only-root Ballast container: BALLAST_HOME's parent and /tmp. */}}
{{- define "ballast.writableVolumes" -}}
- name: home
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}
{{- define "ballast.writableVolumeMounts" -}}
- name: home
  mountPath: /home/ballast
- name: tmp
  mountPath: /tmp
{{- end }}
