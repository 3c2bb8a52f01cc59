//! Making buckets full again on an operator's request (`POST /reset` on the
//! admin port): the buckets a request's descriptors would charge, found
//! exactly as `ShouldRateLimit` finds them (the planner of `limiter::plan`), are forgotten
//! in storage, so the next request sees them full.

use super::plan::{self, Plan};
use super::{DecideError, Limiter, Request};
use crate::metrics as m;
use serde::Serialize;

/// What a reset did, per descriptor of the request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResetOutcome {
    /// The request's domain.
    pub domain: String,
    /// The buckets made full, in descriptor order.
    pub reset: Vec<ResetBucket>,
    /// The descriptors that map to no bucket, with why.
    pub not_reset: Vec<NotReset>,
}

/// One bucket made full.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ResetBucket {
    /// Index of the descriptor in the request.
    pub descriptor: usize,
    /// The rule's path (`domain.key_value...`), or `None` for a `limit`
    /// override on a descriptor that matches no rule.
    pub rule: Option<String>,
    /// The rule's `name`, when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether the descriptor carried a `limit` override (whose bucket, one
    /// per override rate, is the one reset).
    pub by_override: bool,
    /// The storage key of the bucket (bounded: long values are hashed).
    pub bucket: String,
    /// Whether the bucket held tokens' state, that is, was not full already.
    pub was_drained: bool,
}

/// A descriptor that maps to no bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NotReset {
    /// Index of the descriptor in the request.
    pub descriptor: usize,
    /// `no limit` (no rule, replaced, unknown domain, empty or longer than
    /// any rule) or `unlimited`.
    pub reason: &'static str,
}

impl Limiter {
    /// Makes full every bucket that `req`'s descriptors map to (as
    /// `ShouldRateLimit` would charge them: the same rules, `replaces`,
    /// overrides and keys), logs one audit line and counts the buckets in
    /// `bucket_rls_bucket_resets_total`. Costs (`hits_addend`) play no
    /// part. Afterwards the same request is admitted with
    /// `limit_remaining` = burst − cost.
    ///
    /// # Errors
    /// [`DecideError::Invalid`] for a malformed request (as
    /// [`Limiter::decide`]); [`DecideError::NoConfig`] before a first xDS
    /// config; [`DecideError::Storage`] when storage fails (the buckets may
    /// or may not have been reset; a reset can be repeated safely).
    pub async fn reset(&self, req: &Request<'_>) -> Result<ResetOutcome, DecideError> {
        req.validate(super::Bounds {
            max_descriptors: self.settings.max_descriptors,
        })?;
        if self.config.is_awaiting_first_config() {
            return Err(DecideError::NoConfig);
        }
        let config = self.config.load();
        let mut out = ResetOutcome {
            domain: req.domain.to_owned(),
            reset: Vec::new(),
            not_reset: Vec::new(),
        };
        let Some(domain) = config.domains.get(req.domain) else {
            out.not_reset = (0..req.descriptors.len())
                .map(|descriptor| NotReset {
                    descriptor,
                    reason: "no limit",
                })
                .collect();
            audit(&out);
            return Ok(out);
        };
        let (plans, charges) = plan::plan(domain, req, &self.settings, &self.value_labels);
        for (descriptor, p) in plans.iter().enumerate() {
            match p {
                Plan::Limited { charge, rule, .. } => {
                    let rule = rule.map(|i| &domain.rules[i]);
                    out.reset.push(ResetBucket {
                        descriptor,
                        rule: rule.map(|r| r.path.clone()),
                        name: rule.and_then(|r| r.name.clone()),
                        by_override: req.descriptors[descriptor].limit.is_some(),
                        bucket: charges[*charge].key.clone(),
                        was_drained: false,
                    });
                }
                Plan::Unlimited => out.not_reset.push(NotReset {
                    descriptor,
                    reason: "unlimited",
                }),
                Plan::NoLimit => out.not_reset.push(NotReset {
                    descriptor,
                    reason: "no limit",
                }),
            }
        }
        drop(config);
        if out.reset.is_empty() {
            audit(&out);
            return Ok(out);
        }
        let keys: Vec<&str> = out.reset.iter().map(|b| b.bucket.as_str()).collect();
        let held = match self.storage.reset(&keys).await {
            Ok(held) => held,
            Err(e) => {
                tracing::warn!(
                    domain = %super::labels::ValueLabels::clip(req.domain),
                    buckets = keys.len(),
                    error = %e,
                    "bucket reset failed (POST /reset)"
                );
                return Err(DecideError::Storage(e));
            }
        };
        for (b, held) in out.reset.iter_mut().zip(held) {
            b.was_drained = held;
        }
        metrics::counter!(m::BUCKET_RESETS).increment(out.reset.len() as u64);
        audit(&out);
        Ok(out)
    }
}

/// Most rule paths one audit line names (the rest are counted).
const AUDIT_RULES: usize = 16;

/// The one log line of a reset: the domain (cut to a label's length: it is
/// the client's text), how many buckets were made full and how many of
/// them were drained, and the rules (config text), at most
/// [`AUDIT_RULES`]. Bucket keys carry client values and are not logged.
fn audit(out: &ResetOutcome) {
    let mut rules: Vec<&str> = out
        .reset
        .iter()
        .map(|b| b.rule.as_deref().unwrap_or("(override without a rule)"))
        .collect();
    rules.dedup();
    let more = rules.len().saturating_sub(AUDIT_RULES);
    rules.truncate(AUDIT_RULES);
    tracing::info!(
        audit = true,
        domain = %super::labels::ValueLabels::clip(&out.domain),
        buckets = out.reset.len(),
        drained = out.reset.iter().filter(|b| b.was_drained).count(),
        not_reset = out.not_reset.len(),
        rules = %rules.join(","),
        more_rules = more,
        "buckets reset to full (POST /reset)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::compile::compile_texts;
    use crate::limiter::Descriptor;
    use crate::settings::ServiceSettings;
    use crate::storage::memory::MemoryStorage;
    use std::sync::Arc;

    /// One audit line per reset, naming the domain, the rules and the
    /// counts; the bucket keys (client values) are not logged.
    #[test]
    fn a_reset_logs_one_audit_line_without_client_values() {
        let yaml = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
        let config = compile_texts(&[("d.yaml".into(), yaml.as_bytes().to_vec())]).unwrap();
        let l = Limiter::new(
            config,
            Arc::new(MemoryStorage::default()),
            ServiceSettings::default(),
        );
        let req = Request {
            domain: "d",
            descriptors: vec![Descriptor::new(vec![("user", "secret-token-value")])],
            hits_addend: 0,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let log = crate::test_log::logged(tracing::Level::INFO, || {
            rt.block_on(async {
                l.decide(&req).await.expect("charged");
                let out = l.reset(&req).await.expect("reset");
                assert!(out.reset[0].was_drained, "{out:?}");
            });
        });
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("audit=true")).collect();
        assert_eq!(lines.len(), 1, "{log}");
        for needle in [
            "domain=d",
            "buckets=1",
            "drained=1",
            "rules=d.user",
            "POST /reset",
        ] {
            assert!(lines[0].contains(needle), "{needle}: {}", lines[0]);
        }
        assert!(!log.contains("secret-token-value"), "{log}");
    }
}
