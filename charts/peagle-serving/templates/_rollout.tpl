{{/*
Rollout (peagle.rollout): the stable endpoint object (routing.*) and KServe's own canaries (kserve.canary,
kserve.canaryTrafficPercent). Combinations that cannot split traffic are refused at render time.
*/}}

{{- define "peagle-serving.rawDeployment" -}}
{{- if and (eq .Values.mode "kserve") (has .Values.kserve.deploymentMode (list "RawDeployment" "Standard")) }}true{{ end -}}
{{- end -}}

{{/* The Service the routing object sends the stable's share to: the Deployment's, or KServe's predictor Service. */}}
{{- define "peagle-serving.stableService" -}}
{{- if eq .Values.mode "kserve" -}}
{{- printf "%s-predictor" (include "peagle-serving.fullname" .) -}}
{{- else -}}
{{- include "peagle-serving.fullname" . -}}
{{- end -}}
{{- end -}}

{{/* That Service's port: the chart's Service listens on vllm.port; KServe's predictor Service on 80. */}}
{{- define "peagle-serving.stableServicePort" -}}
{{- if eq .Values.mode "kserve" }}80{{ else }}{{ int .Values.vllm.port }}{{ end -}}
{{- end -}}

{{- define "peagle-serving.checkRollout" -}}
{{- $r := .Values.routing -}}
{{- $k := .Values.kserve -}}
{{- $ctp := not (kindIs "invalid" $k.canaryTrafficPercent) -}}
{{- if ne $r.kind "none" -}}
{{- if and (eq .Values.mode "kserve") (not (include "peagle-serving.rawDeployment" .)) -}}
{{- fail (printf "routing.kind=%s needs mode=deployment or kserve.deploymentMode RawDeployment/Standard (got %q): in Serverless mode Knative routes the predictor itself, use kserve.canaryTrafficPercent" $r.kind $k.deploymentMode) -}}
{{- end -}}
{{- if $k.canary.enabled -}}
{{- fail (printf "routing.kind=%s and kserve.canary.enabled would split the traffic twice: use one of them" $r.kind) -}}
{{- end -}}
{{- if and (eq $r.kind "route") .Values.route.enabled (eq .Values.mode "kserve") -}}
{{- fail "routing.kind=route with route.enabled=true: OpenShift AI would create a second Route for the exposed InferenceService; use one of them" -}}
{{- end -}}
{{- if and (eq $r.kind "httproute") (not $r.gateway.name) -}}
{{- fail "routing.gateway.name is required with routing.kind=httproute: the Gateway the HTTPRoute attaches to" -}}
{{- end -}}
{{- else if $r.canary.service -}}
{{- fail "routing.canary.service needs routing.kind=route or routing.kind=httproute" -}}
{{- end -}}
{{- if and (gt (int $r.canary.weight) 0) (not $r.canary.service) -}}
{{- fail (printf "routing.canary.weight=%d needs routing.canary.service, the canary's Service" (int $r.canary.weight)) -}}
{{- end -}}
{{- if and $r.canary.service (eq $r.canary.service (include "peagle-serving.stableService" .)) -}}
{{- fail (printf "routing.canary.service %s is the stable Service itself" $r.canary.service) -}}
{{- end -}}
{{- if and (ne .Values.mode "kserve") (or $k.canary.enabled $ctp) -}}
{{- fail "kserve.canary and kserve.canaryTrafficPercent need mode=kserve (mode=deployment splits traffic with routing.kind)" -}}
{{- end -}}
{{- if eq .Values.mode "kserve" -}}
{{- if and $k.canary.enabled (not (include "peagle-serving.rawDeployment" .)) -}}
{{- fail (printf "kserve.canary needs kserve.deploymentMode RawDeployment or Standard (KServe >= 0.20 spec.canary), got %q: Serverless/Knative use kserve.canaryTrafficPercent" $k.deploymentMode) -}}
{{- end -}}
{{- if and $k.canary.enabled (not $k.canary.name) -}}
{{- fail "kserve.canary.name is required with kserve.canary.enabled=true: the canary predictor's name" -}}
{{- end -}}
{{- if and $k.canary.enabled (eq $k.canary.name $k.predictorName) -}}
{{- fail (printf "kserve.canary.name %s is the predictor's own name (kserve.predictorName)" $k.canary.name) -}}
{{- end -}}
{{- if and $ctp (not (has $k.deploymentMode (list "Serverless" "Knative"))) -}}
{{- fail (printf "kserve.canaryTrafficPercent works only with kserve.deploymentMode Serverless or Knative, got %q: RawDeployment/Standard use kserve.canary or routing.kind" $k.deploymentMode) -}}
{{- end -}}
{{- end -}}
{{- end -}}
