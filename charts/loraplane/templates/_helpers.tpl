{{/* Names, labels and the pieces every component shares. */}}

{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "loraplane.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "loraplane.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", for a dict {root, component}. */}}
{{- define "loraplane.componentName" -}}
{{- printf "%s-%s" (include "loraplane.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "loraplane.poolName" -}}
{{- default (include "loraplane.fullname" .) .Values.pool.name -}}
{{- end -}}

{{- define "loraplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplane.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object of one component: {root, component}. */}}
{{- define "loraplane.labels" -}}
{{ include "loraplane.selectorLabels" . }}
app.kubernetes.io/part-of: loraplane
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "loraplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* image: block for a dict with repository, tag, pullPolicy. */}}
{{- define "loraplane.imageOf" -}}
image: {{ printf "%s:%s" .repository .tag | quote }}
imagePullPolicy: {{ .pullPolicy }}
{{- end -}}

{{- define "loraplane.containerSecurity" -}}
securityContext:
{{ toYaml .Values.securityContext | indent 2 }}
{{- end -}}

{{- define "loraplane.podCommon" -}}
securityContext:
{{ toYaml .Values.podSecurityContext | indent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end -}}

{{/* nodeSelector / tolerations / affinity of one component's values. */}}
{{- define "loraplane.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end -}}

{{/* The Redis service host of the bundled Redis. */}}
{{- define "loraplane.redisHost" -}}
{{- printf "%s.%s.svc" (include "loraplane.componentName" (dict "root" . "component" "redis")) .Release.Namespace -}}
{{- end -}}

{{- define "loraplane.redisSecretName" -}}
{{- if .Values.redis.bundled -}}
{{- default (include "loraplane.componentName" (dict "root" . "component" "redis")) .Values.redis.auth.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.passwordSecret.name -}}
{{- end -}}
{{- end -}}

{{- define "loraplane.redisSecretKey" -}}
{{- if .Values.redis.bundled -}}
{{- .Values.redis.auth.secretKey -}}
{{- else -}}
{{- .Values.redis.external.passwordSecret.key -}}
{{- end -}}
{{- end -}}

{{/* Environment of every Redis client: LORAPLANE_REDIS_PASSWORD from the Secret (when there is one). */}}
{{- define "loraplane.redisEnv" -}}
{{- if include "loraplane.redisSecretName" . -}}
- name: LORAPLANE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "loraplane.redisSecretName" . }}
      key: {{ include "loraplane.redisSecretKey" . }}
{{- end -}}
{{- end -}}

{{/* The --redis-url argument: the password is expanded by the kubelet from LORAPLANE_REDIS_PASSWORD. */}}
{{- define "loraplane.redisUrl" -}}
{{- $auth := ternary ":$(LORAPLANE_REDIS_PASSWORD)@" "" (not (empty (include "loraplane.redisSecretName" .))) -}}
{{- if .Values.redis.bundled -}}
{{- printf "redis://%s%s:%d/0" $auth (include "loraplane.redisHost" .) (int .Values.redis.port) -}}
{{- else -}}
{{- $url := required "redis.external.url is required when redis.bundled is false" .Values.redis.external.url -}}
{{- if not (regexMatch "^rediss?://[^@/]+(/[0-9]+)?$" $url) -}}
{{- fail (printf "redis.external.url %q must be redis://host:port[/db] or rediss://host:port[/db], without a password (use redis.external.passwordSecret)" $url) -}}
{{- end -}}
{{- $parts := regexSplit "://" $url 2 -}}
{{- printf "%s://%s%s" (index $parts 0) $auth (index $parts 1) -}}
{{- end -}}
{{- end -}}

{{/* Labels that let a pod through the Redis NetworkPolicy. */}}
{{- define "loraplane.redisClientLabel" -}}
loraplane.io/redis-client: "true"
{{- end -}}

{{/* PodDisruptionBudget for {root, component, pdb}. */}}
{{- define "loraplane.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "loraplane.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
{{ include "loraplane.labels" . | indent 4 }}
spec:
{{ toYaml .pdb | indent 2 }}
  selector:
    matchLabels:
{{ include "loraplane.selectorLabels" . | indent 6 }}
{{- end -}}

{{- define "loraplane.leaseName" -}}
{{- default (include "loraplane.componentName" (dict "root" . "component" "controller")) .Values.controller.leaderElection.leaseName -}}
{{- end -}}
