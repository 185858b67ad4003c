{{/*
Object name: fullnameOverride, else the release name (KServe needs a DNS-1035 label, so the chart
name is not appended).
*/}}
{{- define "peagle-serving.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "peagle-serving.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "peagle-serving.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "peagle-serving.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: llm-serving
{{- end -}}

{{- define "peagle-serving.selectorLabels" -}}
app.kubernetes.io/name: {{ include "peagle-serving.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The ServingRuntime this release renders and its predictor uses (kserve mode). */}}
{{- define "peagle-serving.runtimeName" -}}
{{- default (include "peagle-serving.fullname" .) .Values.runtimeName -}}
{{- end -}}

{{- define "peagle-serving.servedModelName" -}}
{{- default (include "peagle-serving.fullname" .) .Values.vllm.servedModelName -}}
{{- end -}}

{{/*
The draft fingerprint: speculative.draftFingerprint, else the first 12 hex digits of a sha256 over
where the models come from and the speculative config (what decides which draft is served). It is a
pod label and a second served model name, so the pods of a rollout and the endpoint's answer both
say which draft they serve.
*/}}
{{- define "peagle-serving.draftFingerprint" -}}
{{- if .Values.speculative.draftFingerprint -}}
{{- .Values.speculative.draftFingerprint -}}
{{- else -}}
{{- $basis := dict "storage" .Values.storage "models" .Values.models "speculative" (omit .Values.speculative "draftFingerprint") -}}
{{- toJson $basis | sha256sum | trunc 12 -}}
{{- end -}}
{{- end -}}

{{/* Labels of the serving pods beyond the selector: the draft fingerprint, the Kueue queue. */}}
{{- define "peagle-serving.podLabels" -}}
peagle.io/draft-fingerprint: {{ include "peagle-serving.draftFingerprint" . }}
{{- with .Values.kueue.queueName }}
kueue.x-k8s.io/queue-name: {{ . }}
{{- end }}
{{- end -}}

{{/*
An image reference repository[:tag][@digest] (the schema checks each part and that a tag or a digest is set).
*/}}
{{- define "peagle-serving.imageRef" -}}
{{- .repository -}}
{{- with .tag }}:{{ . }}{{ end -}}
{{- with .digest }}@{{ . }}{{ end -}}
{{- end -}}

{{- define "peagle-serving.image" -}}
{{- include "peagle-serving.imageRef" .Values.image -}}
{{- end -}}

{{/*
The init container's image: `fetch.image` over `image`. Its own tag or digest, when it has one; else the
main tag, and the main digest only for the main repository (a digest names one repository's image).
*/}}
{{- define "peagle-serving.fetchImage" -}}
{{- $f := .Values.fetch.image -}}
{{- $ref := dict "repository" (default .Values.image.repository $f.repository) "tag" ($f.tag | default "") "digest" ($f.digest | default "") -}}
{{- if not (or $ref.tag $ref.digest) -}}
{{- $_ := set $ref "tag" (.Values.image.tag | default "") -}}
{{- if not $f.repository }}{{ $_ := set $ref "digest" (.Values.image.digest | default "") }}{{ end -}}
{{- end -}}
{{- if not (or $ref.tag $ref.digest) -}}
{{- fail (printf "fetch.image: %s needs a tag or a digest (image has only a digest, which names another repository's image)" $ref.repository) -}}
{{- end -}}
{{- include "peagle-serving.imageRef" $ref -}}
{{- end -}}

{{- define "peagle-serving.targetPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.models.root) .Values.models.target -}}
{{- end -}}

{{- define "peagle-serving.draftPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.models.root) .Values.models.draft -}}
{{- end -}}

{{/*
The long-form speculative config as compact JSON (keys sorted by toJson). Explicit method and
parallel_drafting: vLLM's auto-detection falls back to draft_model for P-EAGLE checkpoints whose
path lacks "eagle3", which crashes at warm-up.
*/}}
{{- define "peagle-serving.speculativeConfig" -}}
{{- $s := .Values.speculative -}}
{{- $tp := int .Values.vllm.tensorParallelSize -}}
{{- $dtp := int $s.draftTensorParallelSize -}}
{{- if and (ne $dtp 1) (ne $dtp $tp) -}}
{{- fail (printf "speculative.draftTensorParallelSize must be 1 or vllm.tensorParallelSize (%d), got %d" $tp $dtp) -}}
{{- end -}}
{{- $cfg := dict "method" $s.method "model" (include "peagle-serving.draftPath" .) "num_speculative_tokens" (int $s.numSpeculativeTokens) "parallel_drafting" $s.parallelDrafting "draft_tensor_parallel_size" $dtp -}}
{{- with $s.numSpeculativeTokensPerBatchSize -}}
{{- /* vLLM's rules (vllm/v1/spec_decode/dynamic/utils.py), checked here so a bad schedule fails at render, not at
pod start: ranges sorted from 1 (ours also contiguous), lo <= hi, K <= num_speculative_tokens (vLLM would cap it) */ -}}
{{- $next := 1 -}}
{{- range $i, $r := . -}}
{{- $lo := int (index $r 0) -}}{{- $hi := int (index $r 1) -}}{{- $k := int (index $r 2) -}}
{{- if ne $lo $next -}}
{{- fail (printf "speculative.numSpeculativeTokensPerBatchSize[%d] starts at %d: ranges must be sorted and contiguous from 1 (expected %d)" $i $lo $next) -}}
{{- end -}}
{{- if lt $hi $lo -}}
{{- fail (printf "speculative.numSpeculativeTokensPerBatchSize[%d] ends at %d, before its start %d" $i $hi $lo) -}}
{{- end -}}
{{- if gt $k (int $s.numSpeculativeTokens) -}}
{{- fail (printf "speculative.numSpeculativeTokensPerBatchSize[%d] has K=%d above speculative.numSpeculativeTokens (%d)" $i $k (int $s.numSpeculativeTokens)) -}}
{{- end -}}
{{- $next = add1 $hi -}}
{{- end -}}
{{- $_ := set $cfg "num_speculative_tokens_per_batch_size" . -}}
{{- end -}}
{{- toJson (merge $cfg $s.extraConfig) -}}
{{- end -}}

{{/*
vLLM server arguments, one per line as a YAML list. The single source of truth for both modes: the
ServingRuntime carries all of them (the InferenceService adds none), the Deployment the same.
*/}}
{{- define "peagle-serving.vllmArgs" -}}
- {{ printf "--port=%d" (int .Values.vllm.port) | quote }}
- {{ printf "--model=%s" (include "peagle-serving.targetPath" .) | quote }}
- "--served-model-name"
- {{ include "peagle-serving.servedModelName" . | quote }}
- {{ printf "%s:draft-%s" (include "peagle-serving.servedModelName" .) (include "peagle-serving.draftFingerprint" .) | quote }}
- {{ printf "--tensor-parallel-size=%d" (int .Values.vllm.tensorParallelSize) | quote }}
{{- with .Values.vllm.maxModelLen }}
- {{ printf "--max-model-len=%d" (int .) | quote }}
{{- end }}
{{- with .Values.vllm.dtype }}
- {{ printf "--dtype=%s" . | quote }}
{{- end }}
{{- with .Values.vllm.gpuMemoryUtilization }}
- {{ printf "--gpu-memory-utilization=%v" . | quote }}
{{- end }}
{{- if .Values.speculative.enabled }}
- {{ printf "--speculative-config=%s" (include "peagle-serving.speculativeConfig" .) | quote }}
# Per-request acceptance in each response's usage (vLLM refuses it without a speculative config).
- "--per-request-spec-decode-metrics=summary"
{{- end }}
{{- if or .Values.capture.enabled .Values.swap.enabled }}
- "--middleware=peagle.traffic.middleware.CaptureMiddleware"
{{- end }}
{{- if .Values.capture.enabled }}
# Streams end with a usage chunk, which carries the acceptance the capture records.
- "--enable-force-include-usage"
{{- end }}
{{- if .Values.swap.enabled }}
# The draft swap: the peagle-draft engine loads a published draft; every worker reports which draft it serves.
- "--weight-transfer-config={\"backend\": \"peagle-draft\"}"
- "--worker-extension-cls=peagle.swap.engine.DraftSwapWorker"
{{- end }}
{{- range .Values.vllm.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "peagle-serving.env" -}}
# Models are local files: never reach for the Hugging Face Hub.
- name: HF_HUB_OFFLINE
  value: "1"
# HOME and every cache on the writable cache volume: any image, any UID.
- name: HOME
  value: /cache/home
- name: VLLM_CACHE_ROOT
  value: /cache/vllm
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: HF_HOME
  value: /cache/hf
{{- include "peagle-serving.captureEnv" . }}
{{- if .Values.swap.enabled }}
# The swap endpoint's bearer token, from its Secret (never in the rendered objects).
- name: PEAGLE_SWAP_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.swap.tokenSecret.name }}
      key: {{ .Values.swap.tokenSecret.key }}
# A pod that starts after a promotion by swap serves the promoted draft (the pointer, when it names this template's).
- name: PEAGLE_DRAFT_POINTER
  value: /etc/peagle/draft-pointer
- name: PEAGLE_TEMPLATE_DRAFT
  value: {{ include "peagle-serving.draftFingerprint" . | quote }}
{{- end }}
{{- with .Values.vllm.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Capture (peagle.traffic): the middleware's settings, one PEAGLE_CAPTURE_<FIELD> variable per field of
peagle.traffic.settings.CaptureSettings (strings as they are, everything else as JSON: what
CaptureSettings.to_env writes). target_dir/draft_dir are the served directories (the target's recorded
fingerprints of the target and the draft are computed from what answers, as peagle.records.identity names a draft,
so a record names its draft the same way whichever path deployed it). tests/integration/helm/test_traffic_chart.py keeps the names equal to the fields.
*/}}
{{- define "peagle-serving.captureSettings" -}}
{{- $c := .Values.capture -}}
{{- $drafting := .Values.speculative.enabled | default false -}}
{{- $draftDir := ternary (include "peagle-serving.draftPath" .) "" $drafting -}}
{{- toJson (dict "enabled" true "uri" $c.uri "sample_rate" $c.sampleRate "flush_interval_s" $c.flushIntervalSeconds
    "batch_records" $c.batchRecords "queue_records" $c.queueRecords "max_record_bytes" $c.maxRecordBytes
    "retention_days" $c.retentionDays "redact" $c.redact
    "target_dir" (include "peagle-serving.targetPath" .) "draft_dir" $draftDir
    "target_fingerprint" "" "draft_fingerprint" "") -}}
{{- end -}}

{{- define "peagle-serving.captureEnv" -}}
{{- if .Values.capture.enabled }}
{{- $settings := include "peagle-serving.captureSettings" . | fromJson }}
{{- range $field := keys $settings | sortAlpha }}
{{- $v := index $settings $field }}
- name: {{ printf "PEAGLE_CAPTURE_%s" (upper $field) }}
  value: {{ ternary $v (toJson $v) (kindIs "string" $v) | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* S3 credentials as env, every key of a Secret (a data connection): the capture's (an s3:// capture URI)
     and the swap's (swap.s3SecretName, else the model's data connection: the promoted drafts it reads). */}}
{{- define "peagle-serving.captureEnvFrom" -}}
{{- $secrets := list -}}
{{- if and .Values.capture.enabled (hasPrefix "s3://" .Values.capture.uri) }}{{ $secrets = append $secrets .Values.capture.s3SecretName }}{{ end -}}
{{- if .Values.swap.enabled }}
{{- with (.Values.swap.s3SecretName | default (include "peagle-serving.connectionName" .)) }}{{ $secrets = append $secrets . }}{{ end -}}
{{- end -}}
{{- with $secrets | uniq }}
envFrom:
  {{- range . }}
  - secretRef:
      name: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The draft pointer (peagle.swap.pointer): the ConfigMap a promotion by swap writes, read when a pod starts.
     Named after the runtime, so a canary (a runtime of its own) never reads the stable's; optional: without
     it the template's draft serves. */}}
{{- define "peagle-serving.pointerVolumeMount" -}}
{{- if .Values.swap.enabled }}
- name: draft-pointer
  mountPath: /etc/peagle/draft-pointer
  readOnly: true
{{- end }}
{{- end -}}

{{- define "peagle-serving.pointerVolume" -}}
{{- if .Values.swap.enabled }}
- name: draft-pointer
  configMap:
    name: {{ printf "%s-draft" (include "peagle-serving.runtimeName" .) }}
    optional: true
{{- end }}
{{- end -}}

{{- define "peagle-serving.captureOnPvc" -}}
{{- if and .Values.capture.enabled (hasPrefix "/" .Values.capture.uri) }}true{{ end -}}
{{- end -}}

{{- define "peagle-serving.captureVolumeMount" -}}
{{- if include "peagle-serving.captureOnPvc" . }}
- name: capture
  mountPath: {{ .Values.capture.uri }}
  {{- with trimAll "/" .Values.capture.pvc.path }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "peagle-serving.captureVolume" -}}
{{- if include "peagle-serving.captureOnPvc" . }}
- name: capture
  persistentVolumeClaim:
    claimName: {{ .Values.capture.pvc.claimName }}
{{- end }}
{{- end -}}

{{/* Fail early on an incomplete capture block, naming the missing value. */}}
{{- define "peagle-serving.checkCapture" -}}
{{- $c := .Values.capture -}}
{{- range .Values.vllm.env -}}
{{- if hasPrefix "PEAGLE_CAPTURE_" (toString .name) }}{{ fail (printf "vllm.env: %s is set by the chart from capture.*; set the capture value instead" .name) }}{{ end -}}
{{- if eq (toString .name) "PEAGLE_SWAP_TOKEN" }}{{ fail "vllm.env: PEAGLE_SWAP_TOKEN comes from swap.tokenSecret (a Secret), never from a value" }}{{ end -}}
{{- if has (toString .name) (list "PEAGLE_DRAFT_POINTER" "PEAGLE_TEMPLATE_DRAFT") }}{{ fail (printf "vllm.env: %s is set by the chart with swap.enabled" .name) }}{{ end -}}
{{- end -}}
{{- if .Values.swap.enabled -}}
{{- if not .Values.swap.tokenSecret.name }}{{ fail "swap.tokenSecret.name is required with swap.enabled=true: the Secret holding the swap endpoint's bearer token" }}{{ end -}}
{{- if not .Values.speculative.enabled }}{{ fail "swap.enabled=true swaps the draft: it needs speculative.enabled=true" }}{{ end -}}
{{- end -}}
{{- if $c.enabled -}}
{{- if not $c.uri }}{{ fail "capture.uri is required with capture.enabled=true (s3://bucket/prefix, or an absolute path on capture.pvc)" }}{{ end -}}
{{- if and (hasPrefix "s3://" $c.uri) (not $c.s3SecretName) }}{{ fail "capture.s3SecretName is required with an s3:// capture.uri: the Secret (e.g. an OpenShift AI data connection) holding the S3 credentials" }}{{ end -}}
{{- if and (hasPrefix "/" $c.uri) (not $c.pvc.claimName) }}{{ fail "capture.pvc.claimName is required with a path capture.uri: the claim mounted there" }}{{ end -}}
{{- end -}}
{{- end -}}

{{- define "peagle-serving.probes" -}}
{{- $port := int .Values.vllm.port -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $p := index $.Values.probes $kind }}
{{ $kind }}Probe:
  httpGet:
    path: /health
    port: {{ $port }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
{{- end }}
{{- end -}}

{{- define "peagle-serving.resources" -}}
{{- $res := deepCopy .Values.resources -}}
{{- $gpus := int .Values.gpu.count -}}
{{- if gt $gpus 0 -}}
{{- $r := default (dict) $res.requests -}}
{{- $_ := set $r .Values.gpu.resourceName (toString $gpus) -}}
{{- $l := default (dict) $res.limits -}}
{{- $_ := set $l .Values.gpu.resourceName (toString $gpus) -}}
{{- $_ := set $res "requests" $r -}}
{{- $_ := set $res "limits" $l -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "peagle-serving.metricsAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.vllm.port | quote }}
prometheus.io/path: /metrics
{{- end -}}

{{/* An endpoint exposed outside the cluster needs authentication, or an explicit opt-out. A routing
object (routing.kind) sends requests straight to the serving port, past any authentication proxy. */}}
{{- define "peagle-serving.checkExposure" -}}
{{- if not .Values.route.allowUnauthenticated -}}
{{- if .Values.route.enabled -}}
{{- if eq .Values.mode "deployment" -}}
{{- fail "route.enabled=true exposes the endpoint without authentication (deployment mode has no authentication): use mode=kserve with kserve.enableAuth=true, or set route.allowUnauthenticated=true to expose it anyway" -}}
{{- else if not .Values.kserve.enableAuth -}}
{{- fail "route.enabled=true with kserve.enableAuth=false exposes the endpoint without authentication: set kserve.enableAuth=true, or route.allowUnauthenticated=true to expose it anyway" -}}
{{- end -}}
{{- else if ne .Values.routing.kind "none" -}}
{{- fail (printf "routing.kind=%s sends requests straight to the serving port, with no authentication in front: set route.allowUnauthenticated=true to route them anyway" .Values.routing.kind) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Upstream KServe reads a data connection through a ServiceAccount (no storage-config Secret there). */}}
{{- define "peagle-serving.s3ServiceAccount" -}}
{{- printf "%s-s3" (include "peagle-serving.fullname" .) -}}
{{- end -}}

{{- define "peagle-serving.upstreamS3" -}}
{{- if and (eq .Values.mode "kserve") (eq .Values.storage.type "dataConnection") (not .Values.kserve.openshiftAI) }}true{{ end -}}
{{- end -}}

{{/* The data connection (Secret) whose credentials fetch the model: storage.dataConnection.name, or
     storage.uris.connection for separate URIs; "" for none. */}}
{{- define "peagle-serving.connectionName" -}}
{{- if eq .Values.storage.type "dataConnection" }}{{ .Values.storage.dataConnection.name }}
{{- else if eq .Values.storage.type "uris" }}{{ .Values.storage.uris.connection }}{{ end -}}
{{- end -}}

{{/* Upstream KServe reads S3 credentials from the predictor's ServiceAccount: the chart's <name>-s3 one
     carries the connection (a data connection, or storage.uris.connection without a serviceAccountName). */}}
{{- define "peagle-serving.s3Credentials" -}}
{{- $s := .Values.storage -}}
{{- if include "peagle-serving.upstreamS3" . }}true
{{- else if and (eq .Values.mode "kserve") (eq $s.type "uris") $s.uris.connection (not .Values.kserve.openshiftAI) (not $s.uris.serviceAccountName) }}true{{ end -}}
{{- end -}}

{{/* OpenShift AI's hardware (3.x) or accelerator (2.x) profile annotations. */}}
{{- define "peagle-serving.profileAnnotations" -}}
{{- $p := .Values.kserve.hardwareProfile -}}
{{- if $p.kind -}}
{{- if not $p.name }}{{ fail (printf "kserve.hardwareProfile.name is required with kserve.hardwareProfile.kind=%s" $p.kind) }}{{ end -}}
{{- if eq $p.kind "hardwareProfile" }}
{{- if not $p.namespace }}{{ fail "kserve.hardwareProfile.namespace is required with kserve.hardwareProfile.kind=hardwareProfile: without it OpenShift AI 3.x looks the profile up in the InferenceService's namespace and refuses it at admission; set the namespace the profile lives in (redhat-ods-applications on OpenShift AI, opendatahub on Open Data Hub, the project's own for a project-scoped profile)" }}{{ end }}
opendatahub.io/hardware-profile-name: {{ $p.name }}
opendatahub.io/hardware-profile-namespace: {{ $p.namespace }}
{{- else }}
opendatahub.io/accelerator-name: {{ $p.name }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Fail early on an incomplete storage block, naming the missing value. */}}
{{- define "peagle-serving.checkStorage" -}}
{{- $s := .Values.storage -}}
{{- if eq $s.type "dataConnection" -}}
{{- if not $s.dataConnection.name }}{{ fail "storage.dataConnection.name is required for storage.type=dataConnection" }}{{ end -}}
{{- if and (include "peagle-serving.upstreamS3" .) (not $s.dataConnection.bucket) }}{{ fail "storage.dataConnection.bucket is required with kserve.openshiftAI=false: upstream KServe reads the bucket from the storageUri, it cannot look into the connection" }}{{ end -}}
{{- else if eq $s.type "uri" -}}
{{- if not $s.uri.uri }}{{ fail "storage.uri.uri is required for storage.type=uri" }}{{ end -}}
{{- if ne .Values.mode "kserve" }}{{ fail "storage.type=uri needs mode=kserve (use dataConnection or pvc with mode=deployment)" }}{{ end -}}
{{- else if eq $s.type "uris" -}}
{{- if not (and $s.uris.target $s.uris.draft) }}{{ fail "storage.uris.target and storage.uris.draft are required for storage.type=uris" }}{{ end -}}
{{- if ne .Values.mode "kserve" }}{{ fail "storage.type=uris needs mode=kserve (KServe >= 0.16 predictor.storageUris)" }}{{ end -}}
{{- else if eq $s.type "pvc" -}}
{{- if not $s.pvc.claimName }}{{ fail "storage.pvc.claimName is required for storage.type=pvc" }}{{ end -}}
{{- end -}}
{{- end -}}
