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

{{/* The Redis ACL users of the bundled Redis: one per component; the Secret holds each one's password under the
user's name (the admin's under redis.auth.secretKey). */}}
{{- define "loraplane.redisUsers" -}}
{{- list "controller" "picker" "sidecar" | toJson -}}
{{- end -}}

{{/* Environment of a Redis client {root, user}: its ACL user and password (never on the command line), and the
CA bundle with TLS. */}}
{{- define "loraplane.redisEnv" -}}
{{- $root := .root -}}
{{- $secret := include "loraplane.redisSecretName" $root -}}
{{- if $root.Values.redis.bundled }}
- {name: LORAPLANE_REDIS_USERNAME, value: {{ .user }}}
- name: LORAPLANE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary (include "loraplane.redisSecretKey" $root) .user (eq .user "admin") }}
{{- else }}
{{- with $root.Values.redis.external.username }}
- {name: LORAPLANE_REDIS_USERNAME, value: {{ . | quote }}}
{{- end }}
{{- if $secret }}
- name: LORAPLANE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "loraplane.redisSecretKey" $root }}
{{- end }}
{{- end }}
{{- with $root.Values.redis.external.sentinel }}
{{- if and (not $root.Values.redis.bundled) .addresses }}
{{- with .username }}
- {name: LORAPLANE_REDIS_SENTINEL_USERNAME, value: {{ . | quote }}}
{{- end }}
{{- if .passwordSecret.name }}
- name: LORAPLANE_REDIS_SENTINEL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .passwordSecret.name }}
      key: {{ .passwordSecret.key }}
{{- end }}
{{- end }}
{{- end }}
{{- if $root.Values.redis.tls.enabled }}
- {name: LORAPLANE_REDIS_CA_FILE, value: /etc/loraplane/redis-tls/ca.crt}
{{- end }}
{{- end -}}

{{/* The CA volume and its mount of a Redis client with TLS (empty without TLS). */}}
{{- define "loraplane.redisTlsVolume" -}}
{{- if .Values.redis.tls.enabled }}
- name: redis-tls
  secret:
    secretName: {{ required "redis.tls.secretName is required with redis.tls.enabled" .Values.redis.tls.secretName }}
{{- end }}
{{- end -}}
{{- define "loraplane.redisTlsMount" -}}
{{- if .Values.redis.tls.enabled }}
- {name: redis-tls, mountPath: /etc/loraplane/redis-tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* The --redis-url argument: no credentials in it (they come from the environment, see loraplane.redisEnv); for
a Sentinel-managed Redis redis+sentinel://<addresses>/<serviceName>/<db> (loraplane.credentials). */}}
{{- define "loraplane.redisUrl" -}}
{{- if .Values.redis.bundled -}}
{{- printf "%s://%s:%d/0" (ternary "rediss" "redis" .Values.redis.tls.enabled) (include "loraplane.redisHost" .) (int .Values.redis.port) -}}
{{- else if .Values.redis.external.sentinel.addresses -}}
{{- $s := .Values.redis.external.sentinel -}}
{{- if .Values.redis.external.url -}}
{{- fail "redis.external: set url or sentinel.addresses, not both" -}}
{{- end -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*$" $s.serviceName) -}}
{{- fail (printf "redis.external.sentinel.serviceName %q: the name the sentinels monitor the primary under is required with sentinel.addresses" $s.serviceName) -}}
{{- end -}}
{{- printf "%s://%s/%s/%d" (ternary "rediss+sentinel" "redis+sentinel" .Values.redis.tls.enabled) (join "," $s.addresses) $s.serviceName (int $s.db) -}}
{{- else -}}
{{- $url := required "redis.external.url (or redis.external.sentinel.addresses) is required when redis.bundled is false" .Values.redis.external.url -}}
{{- if not (regexMatch "^rediss?://[^@/]+(/[0-9]+)?$" $url) -}}
{{- fail (printf "redis.external.url %q must be redis://host:port[/db] or rediss://host:port[/db], without a password (use redis.external.passwordSecret)" $url) -}}
{{- end -}}
{{- $url -}}
{{- end -}}
{{- end -}}

{{/* The bundled Redis's ACL rules of each component user, for pool $pool (key names of loraplane.api.keys):
the controller writes target states and the route table; sidecars their reports and the report index; the
picker the request rates and its counters; everyone reads the pool's keys but the sidecars, which read only the
target states. The default user is off: without a password nothing runs. */}}
{{- define "loraplane.redisAcl" -}}
{{- $p := printf "loraplane:{%s}" (include "loraplane.poolName" .) -}}
{{- $connect := "+ping +echo +hello +client|setname +client|id +select" -}}
{{- $read := "+get +mget +smembers +scan +exists +ttl +pttl +type" -}}
user default off resetkeys resetchannels -@all
user admin on #ADMIN_HASH ~* &* +@all
user controller on #CONTROLLER_HASH resetkeys %R~{{ $p }}:* %W~{{ $p }}:target:* %W~{{ $p }}:target-spec:* %W~{{ $p }}:routes* %W~{{ $p }}:status:* resetchannels &{{ $p }}:target-changed &{{ $p }}:routes-changed -@all {{ $connect }} {{ $read }} +set +expire +publish
user picker on #PICKER_HASH resetkeys %R~{{ $p }}:* %W~{{ $p }}:rates:* %W~{{ $p }}:counters:* %W~{{ $p }}:in-flight:* resetchannels &{{ $p }}:residency-changed &{{ $p }}:routes-changed &{{ $p }}:kv-blocks-changed -@all {{ $connect }} {{ $read }} +subscribe +unsubscribe +set
user sidecar on #SIDECAR_HASH resetkeys %R~{{ $p }}:target:* %R~{{ $p }}:target-spec:* %W~{{ $p }}:residency:* %W~{{ $p }}:residency-pods %W~{{ $p }}:kv-blocks:* resetchannels &{{ $p }}:target-changed &{{ $p }}:residency-changed &{{ $p }}:kv-blocks-changed -@all {{ $connect }} +get +mget +subscribe +unsubscribe +set +sadd +publish +multi +exec +discard
{{- end -}}

{{/* The Secret of the model servers' admin token (templates/runtime-token.yaml). */}}
{{- define "loraplane.runtimeTokenSecret" -}}
{{- printf "%s-runtime-token" (include "loraplane.fullname" . | trunc 48 | trimSuffix "-") -}}
{{- end -}}

{{/* An environment variable {root, name} holding the runtime admin token. */}}
{{- define "loraplane.runtimeTokenEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef: {name: {{ include "loraplane.runtimeTokenSecret" .root }}, key: token}
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
