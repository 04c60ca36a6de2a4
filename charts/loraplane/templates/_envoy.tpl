{{/* The standalone Envoy's bootstrap: the ext_proc filter calls the picker, which names its ordered endpoints in
the envoy.lb metadata (and the first in x-gateway-destination-endpoint); the model-servers cluster (the pods of a
headless Service) is balanced by Envoy's override-host policy, which sends the request to the first and, on a
retry (refused, reset or closed before response headers), to the next. A client's own copy of the header is
removed before the picker runs, only the inference paths are routed, and header, stream-idle and connection-idle
timeouts bound what a slow or stalled client may hold. The picker cluster lists every replica (a headless
Service), checks each one's gRPC health and ejects one that refuses connections; both clusters' circuit breakers
sit above what the picker admits (it answers 429 / 503 with a reason past its own queue limits). */}}
{{- define "loraplane.envoyBootstrap" -}}
{{- $e := .Values.gateway.envoy -}}
{{- $picker := printf "%s-replicas.%s.svc" (include "loraplane.componentName" (dict "root" . "component" "picker")) .Release.Namespace -}}
{{- $hc := $e.pickerHealthCheck -}}
{{- $endpoints := printf "%s.%s.svc" (include "loraplane.componentName" (dict "root" . "component" "model-server")) .Release.Namespace -}}
{{- $noExtProc := dict "envoy.filters.http.ext_proc" (dict "@type" "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute" "disabled" true) -}}
node:
  id: {{ include "loraplane.componentName" (dict "root" . "component" "envoy") }}
  cluster: {{ include "loraplane.componentName" (dict "root" . "component" "envoy") }}
admin:
  address:
    socket_address: {address: 127.0.0.1, port_value: {{ $e.adminPort }}}
static_resources:
  listeners:
    - name: inference
      address:
        socket_address: {address: 0.0.0.0, port_value: {{ $e.port }}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: inference
                request_headers_timeout: {{ $e.timeouts.requestHeaders }}
                stream_idle_timeout: {{ $e.timeouts.streamIdle }}
                common_http_protocol_options:
                  idle_timeout: {{ $e.timeouts.connectionIdle }}
                use_remote_address: true
                normalize_path: true
                merge_slashes: true
                path_with_escaped_slashes_action: REJECT_REQUEST
                route_config:
                  name: inference
                  virtual_hosts:
                    - name: inference
                      domains: ["*"]
                      routes:
                        - match: {path: /ready}
                          direct_response: {status: 200, body: {inline_string: "ready\n"}}
                          typed_per_filter_config: {{ toJson $noExtProc }}
                        {{- range .Values.inferencePaths }}
                        - match: {path: {{ . }}}
                          route:
                            cluster: model-servers
                            timeout: {{ $.Values.gateway.requestTimeout }}
                            {{- if $e.retries }}
                            retry_policy:
                              retry_on: connect-failure,reset,refused-stream{{ if $e.retryStatuses }},retriable-status-codes{{ end }}
                              num_retries: {{ $e.retries }}
                              {{- with $e.retryStatuses }}
                              retriable_status_codes: {{ toJson . }}
                              {{- end }}
                            {{- end }}
                        {{- end }}
                        - match: {prefix: /}
                          direct_response: {status: 404, body: {inline_string: "not an inference path\n"}}
                          typed_per_filter_config: {{ toJson $noExtProc }}
                http_filters:
                  {{- if ne .Values.modelServer.runtime "engine" }}
                  # vLLM's --api-key: the token goes on every forwarded request (the client's own is replaced).
                  - name: envoy.filters.http.credential_injector
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.credential_injector.v3.CredentialInjector
                      overwrite: true
                      credential:
                        name: envoy.http.injected_credentials.generic
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.http.injected_credentials.generic.v3.Generic
                          credential:
                            name: runtime-token
                            sds_config:
                              path_config_source: {path: /etc/envoy/runtime-token/envoy-sds.yaml}
                          header: Authorization
                  {{- end }}
                  - name: envoy.filters.http.header_mutation
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
                      mutations:
                        request_mutations:
                          - remove: x-gateway-destination-endpoint
                  - name: envoy.filters.http.ext_proc
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
                      grpc_service:
                        envoy_grpc: {cluster_name: picker}
                        timeout: {{ .Values.gateway.requestTimeout }}
                      failure_mode_allow: {{ eq .Values.pool.failureMode "FailOpen" }}
                      message_timeout: {{ $e.pickerMessageTimeout }}
                      processing_mode:
                        request_header_mode: SEND
                        response_header_mode: SEND
                        request_body_mode: {{ $e.bodyMode }}
                        response_body_mode: {{ $e.bodyMode }}
                        {{- if eq $e.bodyMode "FULL_DUPLEX_STREAMED" }}
                        request_trailer_mode: SEND
                        response_trailer_mode: SEND
                        {{- end }}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: picker
      type: STRICT_DNS
      connect_timeout: 2s
      lb_policy: ROUND_ROBIN
      dns_lookup_family: V4_ONLY
      circuit_breakers: {{ include "loraplane.envoyCircuitBreakers" $e.maxRequests }}
      health_checks:
        - timeout: {{ $hc.timeout }}
          interval: {{ $hc.interval }}
          no_traffic_interval: {{ $hc.interval }}
          unhealthy_threshold: 3
          healthy_threshold: 1
          grpc_health_check: {service_name: envoy.service.ext_proc.v3.ExternalProcessor}
      outlier_detection:
        split_external_local_origin_errors: true
        consecutive_local_origin_failure: 1
        enforcing_consecutive_local_origin_failure: 100
        interval: {{ $hc.interval }}
        base_ejection_time: {{ $hc.ejectionTime }}
        max_ejection_percent: 100
      # below half the replicas healthy, route to all: a dead one refuses at once anyway, while checks that a
      # starved node failed on every replica would otherwise cut off every request
      common_lb_config: {healthy_panic_threshold: {value: 50}}
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {max_concurrent_streams: {{ .Values.picker.maxConcurrentStreams }}}
      load_assignment:
        cluster_name: picker
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {address: {{ $picker }}, port_value: {{ .Values.picker.ports.grpc }}}
                  health_check_config: {port_value: {{ .Values.picker.ports.health }}}
    - name: model-servers
      type: STRICT_DNS
      connect_timeout: 5s
      circuit_breakers: {{ include "loraplane.envoyCircuitBreakers" $e.maxRequests }}
      load_assignment:
        cluster_name: model-servers
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: {address: {{ $endpoints }}, port_value: {{ .Values.modelServer.port }}}
      load_balancing_policy:
        policies:
          - typed_extension_config:
              name: envoy.load_balancing_policies.override_host
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
                override_host_sources:
                  - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
                  - header: x-gateway-destination-endpoint
                fallback_policy:
                  policies:
                    - typed_extension_config:
                        name: envoy.load_balancing_policies.round_robin
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
{{- end -}}


{{/* Envoy circuit_breakers (flow style) at the given limit, retries in flight by a budget. */}}
{{- define "loraplane.envoyCircuitBreakers" -}}
{thresholds: [{priority: DEFAULT, max_connections: {{ . }}, max_pending_requests: {{ . }}, max_requests: {{ . }}, retry_budget: {budget_percent: {value: 20.0}, min_retry_concurrency: 32}}]}
{{- end -}}
