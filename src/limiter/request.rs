//! The request as the decision core sees it: a domain, descriptors of
//! `(key, value)` entries and costs, borrowed from whatever the protocol
//! adapter decoded (gRPC or `/json`), with limit overrides in config units.

use crate::config::Unit;
use std::fmt;

/// One `ShouldRateLimit` call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// The domain: which config file's rules apply.
    pub domain: &'a str,
    /// The descriptors, in request order; each gets one status.
    pub descriptors: Vec<Descriptor<'a>>,
    /// Request-wide cost in tokens for descriptors without their own
    /// `hits_addend` (0 means 1, as in Envoy).
    pub hits_addend: u32,
}

/// One descriptor of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor<'a> {
    /// `(key, value)` entries, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// A per-request limit that replaces the rule's (Envoy's
    /// `RateLimitDescriptor.limit`).
    pub limit: Option<Override>,
    /// This descriptor's own cost in tokens; `Some(0)` is a check that takes
    /// nothing. `None` falls back to the request's `hits_addend`.
    pub hits_addend: Option<u64>,
    /// Give the cost back to the bucket instead of taking it (a refund).
    pub is_negative_hits: bool,
}

/// A per-request limit override.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    /// Tokens per unit; also the bucket's capacity.
    pub requests_per_unit: u32,
    /// The unit, or the name (or number) of a unit the service does not
    /// accept (`UNKNOWN`), kept for the error message.
    pub unit: Result<Unit, String>,
}

/// Limits on request shape, from the settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Most descriptors in one request.
    pub max_descriptors: usize,
}

/// Why a request was refused before any rule was looked at (gRPC
/// `INVALID_ARGUMENT`, HTTP 400). Displayed as the message sent back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InvalidRequest {
    /// The domain is empty.
    EmptyDomain,
    /// There are no descriptors.
    NoDescriptors,
    /// More descriptors than [`Bounds::max_descriptors`].
    TooManyDescriptors {
        /// Descriptors in the request.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// A limit override's unit is not `SECOND` ... `YEAR`.
    OverrideUnit {
        /// Index of the descriptor.
        index: usize,
        /// The unit as received.
        unit: String,
    },
}

impl fmt::Display for InvalidRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EmptyDomain => f.write_str("domain must not be empty"),
            Self::NoDescriptors => f.write_str("descriptor list must not be empty"),
            Self::TooManyDescriptors { count, max } => {
                write!(
                    f,
                    "too many descriptors: {count} (at most {max} per request)"
                )
            }
            Self::OverrideUnit { index, unit } => write!(
                f,
                "descriptors[{index}].limit.unit must be SECOND..YEAR, got {unit}"
            ),
        }
    }
}

impl std::error::Error for InvalidRequest {}

impl Request<'_> {
    /// Checks the request's shape: a domain, 1 to `max_descriptors`
    /// descriptors, override units known. A descriptor of any length is
    /// valid: one longer than any rule is answered without a limit, as in
    /// the Go service, so the request's other descriptors are still decided.
    /// The first problem found is reported, in that order.
    ///
    /// # Errors
    /// [`InvalidRequest`] naming the problem and the descriptor index.
    pub fn validate(&self, bounds: Bounds) -> Result<(), InvalidRequest> {
        if self.domain.is_empty() {
            return Err(InvalidRequest::EmptyDomain);
        }
        if self.descriptors.is_empty() {
            return Err(InvalidRequest::NoDescriptors);
        }
        if self.descriptors.len() > bounds.max_descriptors {
            return Err(InvalidRequest::TooManyDescriptors {
                count: self.descriptors.len(),
                max: bounds.max_descriptors,
            });
        }
        for (index, d) in self.descriptors.iter().enumerate() {
            if let Some(Override { unit: Err(u), .. }) = &d.limit {
                return Err(InvalidRequest::OverrideUnit {
                    index,
                    unit: u.clone(),
                });
            }
        }
        Ok(())
    }
}

impl Descriptor<'_> {
    /// A descriptor of `entries` with no override and no own cost.
    #[must_use]
    pub fn new<'a>(entries: Vec<(&'a str, &'a str)>) -> Descriptor<'a> {
        Descriptor {
            entries,
            limit: None,
            hits_addend: None,
            is_negative_hits: false,
        }
    }

    /// This descriptor's cost in tokens: its own `hits_addend`, else the
    /// request's (`request_hits` 0 counts as 1).
    #[must_use]
    pub fn cost(&self, request_hits: u32) -> u64 {
        self.hits_addend
            .unwrap_or_else(|| u64::from(request_hits.max(1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds { max_descriptors: 2 };

    fn req<'a>(domain: &'a str, descriptors: Vec<Descriptor<'a>>) -> Request<'a> {
        Request {
            domain,
            descriptors,
            hits_addend: 0,
        }
    }

    #[test]
    fn problems_are_reported_in_order_with_the_descriptor_index() {
        let d = || Descriptor::new(vec![("k", "v")]);
        assert_eq!(
            req("", vec![]).validate(BOUNDS),
            Err(InvalidRequest::EmptyDomain)
        );
        assert_eq!(
            req("d", vec![]).validate(BOUNDS),
            Err(InvalidRequest::NoDescriptors)
        );
        assert_eq!(
            req("d", vec![d(), d(), d()])
                .validate(BOUNDS)
                .unwrap_err()
                .to_string(),
            "too many descriptors: 3 (at most 2 per request)"
        );
        let mut bad = d();
        bad.limit = Some(Override {
            requests_per_unit: 1,
            unit: Err("UNKNOWN".into()),
        });
        assert_eq!(
            req("d", vec![bad])
                .validate(BOUNDS)
                .unwrap_err()
                .to_string(),
            "descriptors[0].limit.unit must be SECOND..YEAR, got UNKNOWN"
        );
        assert_eq!(req("d", vec![d(), d()]).validate(BOUNDS), Ok(()));
    }

    #[test]
    fn cost_falls_back_to_the_request_and_zero_means_one() {
        let mut d = Descriptor::new(vec![("k", "v")]);
        assert_eq!(d.cost(0), 1);
        assert_eq!(d.cost(7), 7);
        d.hits_addend = Some(0);
        assert_eq!(d.cost(7), 0);
    }
}
