{{/*
The body of an InferenceService predictor. Its context is the release's (`.`) for spec.predictor, or
for spec.canary a copy whose Values are the candidate's (see "peagle-serving.canaryContext"): one
template for both, so a promoted canary's predictor is exactly the one the canary ran.
*/}}
{{- define "peagle-serving.predictor" -}}
{{- $s := .Values.storage -}}
{{- $upstreamS3 := include "peagle-serving.upstreamS3" . -}}
{{- with .Values.kserve.predictorName }}
name: {{ . }}
{{- end }}
{{- if not (kindIs "invalid" .Values.kserve.canaryTrafficPercent) }}
# Serverless: KServe sends this share to the revision of this spec, the rest to the last rolled-out one.
canaryTrafficPercent: {{ int .Values.kserve.canaryTrafficPercent }}
{{- end }}
# On the predictor pods: which draft they serve (peagle deploy waits for pods carrying it).
labels:
  peagle.io/draft-fingerprint: {{ include "peagle-serving.draftFingerprint" . }}
minReplicas: {{ .Values.kserve.minReplicas }}
{{- if not .Values.kserve.asCanary }}
{{- /* KServe refuses a spec.canary predictor that sets maxReplicas: the stable's bounds scale the canary
       (v0.20 pkg/apis/serving/v1beta1/inference_service_validation.go, "must not set maxReplicas"). */}}
maxReplicas: {{ .Values.kserve.maxReplicas }}
{{- end }}
{{- if has .Values.kserve.deploymentMode (list "RawDeployment" "Standard") }}
# A rolling update would wait for GPUs the old pod still holds: replace it instead.
deploymentStrategy:
  type: Recreate
{{- end }}
{{- if not .Values.kserve.enableAuth }}
# vLLM never calls the Kubernetes API (with auth on, OpenShift AI's proxy sidecar needs the token).
automountServiceAccountToken: false
{{- end }}
{{- if include "peagle-serving.s3Credentials" . }}
# Its secret is the data connection: KServe's storage initializer takes the S3 credentials from it.
serviceAccountName: {{ include "peagle-serving.s3ServiceAccount" . }}
{{- else if and (eq $s.type "uri") $s.uri.serviceAccountName }}
serviceAccountName: {{ $s.uri.serviceAccountName }}
{{- else if and (eq $s.type "uris") $s.uris.serviceAccountName }}
serviceAccountName: {{ $s.uris.serviceAccountName }}
{{- end }}
{{- if eq $s.type "uris" }}
# KServe >= 0.16: one storage initializer download per URI, under a common parent.
storageUris:
  - uri: {{ $s.uris.target | quote }}
    mountPath: {{ include "peagle-serving.targetPath" . }}
  - uri: {{ $s.uris.draft | quote }}
    mountPath: {{ include "peagle-serving.draftPath" . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
model:
  # The runtime's container this model spec merges into (spec.canary's schema requires the name).
  name: kserve-container
  modelFormat:
    name: vLLM
  runtime: {{ include "peagle-serving.runtimeName" . }}
  {{- if $upstreamS3 }}
  # Upstream KServe: no storage-config Secret; the bucket and prefix are the URI.
  storageUri: {{ printf "s3://%s/%s" $s.dataConnection.bucket (trimPrefix "/" $s.dataConnection.path) | quote }}
  {{- else if eq $s.type "dataConnection" }}
  # OpenShift AI data connection: odh-model-controller folds it into the storage-config Secret.
  storage:
    key: {{ $s.dataConnection.name }}
    path: {{ $s.dataConnection.path | quote }}
    {{- with $s.dataConnection.bucket }}
    # Overrides the connection's bucket (KServe's storage spec parameters win over storage-config).
    parameters:
      bucket: {{ . | quote }}
    {{- end }}
  {{- else if eq $s.type "uri" }}
  storageUri: {{ $s.uri.uri | quote }}
  {{- else if eq $s.type "pvc" }}
  storageUri: {{ printf "pvc://%s/%s" $s.pvc.claimName (trimPrefix "/" $s.pvc.path) | trimSuffix "/" | quote }}
  {{- end }}
  resources:
    {{- include "peagle-serving.resources" . | nindent 4 }}
{{- end -}}
