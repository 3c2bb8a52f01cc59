//! OpenTelemetry tracing: one server span per `ShouldRateLimit` call and one
//! client span per Redis script call, exported over OTLP/HTTP (protobuf) to
//! a collector.
//!
//! Off unless an endpoint is given (`--otlp-endpoint`, or the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT`); then nothing on the request path touches
//! OpenTelemetry beyond one `OnceLock` read. When on, a W3C `traceparent`
//! (and `tracestate`) in the gRPC request metadata, as Envoy sends it when
//! its own tracing is configured, makes the call's span a child of Envoy's,
//! and the sampler follows the parent's decision (a parent-based sampler
//! with the configured ratio for calls without one). Spans leave in batches
//! at most 1 s old; the queue holds 2048 spans and drops beyond that (a slow
//! collector never slows decisions).

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{
    FutureExt as _, Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

/// How long spans wait in the batch before export.
pub const EXPORT_DELAY: Duration = Duration::from_secs(1);

/// Most spans queued for export; more are dropped.
pub const MAX_QUEUED_SPANS: usize = 2048;

/// Longest domain recorded on a span, in bytes (longer ones are cut at a
/// character boundary).
pub const MAX_DOMAIN_ATTR_BYTES: usize = 128;

/// Tracing settings (`--otlp-endpoint`, `--tracing-service-name`,
/// `--tracing-sampling-rate`).
#[derive(Clone, Debug, PartialEq)]
pub struct TracingSettings {
    /// OTLP/HTTP base URL (`http://collector:4318`); spans go to
    /// `{endpoint}/v1/traces`. `None`: tracing off.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the resource.
    pub service_name: String,
    /// Share of root calls (without a sampled parent) that are traced, 0 to 1.
    pub sampling_rate: f64,
}

impl Default for TracingSettings {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: "bucket-rls".to_owned(),
            sampling_rate: 1.0,
        }
    }
}

/// Errors setting tracing up.
#[derive(Debug, thiserror::Error)]
pub enum TracingError {
    /// The sampling rate is outside 0..=1.
    #[error("tracing sampling rate must be between 0 and 1, got {0}")]
    SamplingRate(f64),
    /// The endpoint is not an `http://` or `https://` URL.
    #[error("OTLP endpoint '{0}' must be an http:// or https:// URL")]
    Endpoint(String),
    /// The exporter could not be built.
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// The running tracer provider; flushes and stops the exporter when
/// dropped (or on [`Tracing::shutdown`]).
#[derive(Debug)]
pub struct Tracing {
    provider: SdkTracerProvider,
}

impl Tracing {
    /// Exports what is queued and stops the exporter.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Tracing {
    fn drop(&mut self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

/// Starts the OTLP exporter when `settings` names an endpoint and makes it
/// the process's tracer; `Ok(None)` when tracing is off. Must run inside a
/// Tokio runtime (the batch exporter is a task). A second call in one
/// process keeps the first tracer.
///
/// # Errors
/// [`TracingError`] for a bad rate or endpoint, or an exporter that cannot
/// be built.
pub fn init(settings: &TracingSettings) -> Result<Option<Tracing>, TracingError> {
    use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
    let Some(endpoint) = &settings.otlp_endpoint else {
        return Ok(None);
    };
    if !(0.0..=1.0).contains(&settings.sampling_rate) {
        return Err(TracingError::SamplingRate(settings.sampling_rate));
    }
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(TracingError::Endpoint(endpoint.clone()));
    }
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(Duration::from_secs(10))
        .with_headers(std::collections::HashMap::new())
        .build()
        .map_err(|e| TracingError::Exporter(e.to_string()))?;
    let batch =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_batch_config(
            opentelemetry_sdk::trace::BatchConfigBuilder::default()
                .with_scheduled_delay(EXPORT_DELAY)
                .with_max_queue_size(MAX_QUEUED_SPANS)
                .build(),
        )
        .build();
    let sampler = opentelemetry_sdk::trace::Sampler::ParentBased(Box::new(
        opentelemetry_sdk::trace::Sampler::TraceIdRatioBased(settings.sampling_rate),
    ));
    let provider = SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_sampler(sampler)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(settings.service_name.clone())
                .build(),
        )
        .build();
    let _ = TRACER.set(opentelemetry::trace::TracerProvider::tracer(
        &provider,
        "bucket-rls",
    ));
    tracing::info!(endpoint = %crate::storage::redis::redact_url(endpoint), rate = settings.sampling_rate, "OTLP tracing on");
    Ok(Some(Tracing { provider }))
}

fn tracer() -> Option<&'static SdkTracer> {
    TRACER.get()
}

/// gRPC request metadata (the request's HTTP/2 headers) as a W3C trace
/// context carrier; binary metadata (`-bin` names) is left out.
struct Metadata<'a>(&'a http::HeaderMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .map(http::HeaderName::as_str)
            .filter(|k| !k.ends_with("-bin"))
            .collect()
    }
}

fn clip(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Runs `call` (one `ShouldRateLimit`) inside a server span, child of the
/// trace context in `metadata`; `outcome` names the answer
/// (`OK`, `OVER_LIMIT`, or the gRPC error code) for the span. Without a
/// tracer, just runs `call`.
pub async fn should_rate_limit<T, E, F>(
    metadata: &http::HeaderMap,
    domain: &str,
    descriptors: usize,
    call: F,
    outcome: impl FnOnce(&Result<T, E>) -> (String, bool),
) -> Result<T, E>
where
    F: Future<Output = Result<T, E>>,
{
    let Some(tracer) = tracer() else {
        return call.await;
    };
    let parent =
        opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&Metadata(metadata));
    let span = tracer
        .span_builder("envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.service", "envoy.service.ratelimit.v3.RateLimitService"),
            KeyValue::new("rpc.method", "ShouldRateLimit"),
            KeyValue::new("ratelimit.domain", clip(domain, MAX_DOMAIN_ATTR_BYTES)),
            KeyValue::new(
                "ratelimit.descriptors",
                i64::try_from(descriptors).unwrap_or(i64::MAX),
            ),
        ])
        .start_with_context(tracer, &parent);
    let cx = parent.with_span(span);
    let result = call.with_context(cx.clone()).await;
    let (code, error) = outcome(&result);
    let span = cx.span();
    if error {
        span.set_status(Status::error(code.clone()));
    }
    span.set_attribute(KeyValue::new("ratelimit.overall_code", code));
    span.end();
    result
}

/// Runs `call` (one quota usage report of a `StreamRateLimitQuotas`
/// stream) inside a server span, child of the trace context in `metadata`
/// (the stream's headers), with the domain and the number of buckets
/// reported; a failed call marks the span failed with its message. Without
/// a tracer, just runs `call`.
pub async fn quota_report<T, E: std::fmt::Display, F>(
    metadata: &http::HeaderMap,
    domain: &str,
    buckets: usize,
    call: F,
) -> Result<T, E>
where
    F: Future<Output = Result<T, E>>,
{
    let Some(tracer) = tracer() else {
        return call.await;
    };
    let parent =
        opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&Metadata(metadata));
    let span = tracer
        .span_builder(
            "envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas report",
        )
        .with_kind(SpanKind::Server)
        .with_attributes([
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new(
                "rpc.service",
                "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
            ),
            KeyValue::new("rpc.method", "StreamRateLimitQuotas"),
            KeyValue::new("ratelimit.domain", clip(domain, MAX_DOMAIN_ATTR_BYTES)),
            KeyValue::new(
                "ratelimit.buckets",
                i64::try_from(buckets).unwrap_or(i64::MAX),
            ),
        ])
        .start_with_context(tracer, &parent);
    let cx = parent.with_span(span);
    let result = call.with_context(cx.clone()).await;
    let span = cx.span();
    if let Err(e) = &result {
        span.set_status(Status::error(clip(&e.to_string(), 256)));
    }
    span.end();
    result
}

/// A client span around one Redis script call, child of the current
/// `ShouldRateLimit` span; `None` without a tracer.
pub struct RedisSpan(opentelemetry_sdk::trace::Span);

impl RedisSpan {
    /// Starts the span for a script call over `keys` bucket keys, sent as
    /// `command` (`FCALL`, or `EVALSHA` where Redis refuses Functions): the
    /// span's name and `db.operation.name`.
    #[must_use]
    pub fn start(keys: usize, command: &'static str) -> Option<Self> {
        let tracer = tracer()?;
        let span = tracer
            .span_builder(command)
            .with_kind(SpanKind::Client)
            .with_attributes([
                KeyValue::new("db.system.name", "redis"),
                KeyValue::new("db.operation.name", command),
                KeyValue::new("ratelimit.buckets", i64::try_from(keys).unwrap_or(i64::MAX)),
            ])
            .start_with_context(tracer, &Context::current());
        Some(Self(span))
    }

    /// Ends the span, marking it failed with `error` if given.
    pub fn end(mut self, error: Option<&dyn std::fmt::Display>) {
        if let Some(e) = error {
            self.0.set_status(Status::error(clip(&e.to_string(), 256)));
        }
        self.0.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused_and_no_endpoint_means_off() {
        assert!(matches!(init(&TracingSettings::default()), Ok(None)));
        let rate = TracingSettings {
            otlp_endpoint: Some("http://127.0.0.1:4318".into()),
            sampling_rate: 1.5,
            ..TracingSettings::default()
        };
        assert_eq!(
            init(&rate).unwrap_err().to_string(),
            "tracing sampling rate must be between 0 and 1, got 1.5"
        );
        let url = TracingSettings {
            otlp_endpoint: Some("collector:4318".into()),
            ..TracingSettings::default()
        };
        assert_eq!(
            init(&url).unwrap_err().to_string(),
            "OTLP endpoint 'collector:4318' must be an http:// or https:// URL"
        );
    }

    #[test]
    fn long_domains_are_clipped_at_a_character_boundary() {
        let d = "é".repeat(100);
        let c = clip(&d, MAX_DOMAIN_ATTR_BYTES);
        assert_eq!(c.len(), 128);
        assert!(d.starts_with(&c));
        assert_eq!(clip("ab", 10), "ab");
    }
}
