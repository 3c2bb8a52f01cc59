//! What storage keeps for Envoy's quota service (RLQS): per rule bucket,
//! the subscribers that report it (one per Envoy stream, on any replica),
//! each with its demand, the assignment it holds and when it last reported,
//! beside the bucket itself, which every report charges with what the
//! Envoys allowed (docs/design.md, "Quota sharing").
//!
//! [`Storage::report`](super::Storage::report) takes the bucket entries of one
//! usage report message at once (one Redis script call; on a Cluster one per
//! hash slot of the entries' buckets); each entry:
//! charges `charge` (a consume with debt, so the allowed count is taken
//! even past the balance, down to the debt bound), drops records not
//! refreshed for `live_ms`, upserts `subscriber`'s record with its held
//! assignment cut to what the other live records leave of `budget`
//! ([`fit`]; atomic with the read of those records, so the recorded
//! assignments of a bucket never sum above the budget, whatever the
//! interleaving of streams and replicas), and returns what is left: the
//! bucket's balance and every live subscriber.

use super::ChargeSpec;

/// The key of a bucket's subscriber records, in the bucket key's Redis
/// Cluster hash slot, so that the one quota script call of a bucket (charge
/// it, record its subscriber) touches one slot:
/// - `<prefix>q{<bucket key>}` when the bucket key has no hash tag (then
///   its slot is the CRC16 of the whole key, and the braces make that the
///   slot of this key too);
/// - `<prefix>q<bucket key after the prefix>` when it has one: client text
///   never forms a tag ([`super::key`] escapes `{` and `}`), so the tag is
///   the prefix's, and every key starting with the prefix shares it.
///
/// Bucket keys continue the prefix with `d`, so no bucket key has this name;
/// on Redis it is a hash. A prefix with a `{` or `}` that forms no hash tag
/// (`rls{:`) leaves no such name: the bucket key holds a brace outside any
/// tag, so no tag can repeat it; the Cluster backend then refuses the report
/// (its slots differ), the other backends do not mind.
#[must_use]
pub fn subscribers_key(prefix: &str, bucket_key: &str) -> String {
    let rest = bucket_key.strip_prefix(prefix).unwrap_or(bucket_key);
    let tagged = super::redis::cluster::hash_tag(bucket_key.as_bytes()).is_some();
    let mut k = String::with_capacity(prefix.len() + 3 + bucket_key.len());
    k.push_str(prefix);
    k.push('q');
    if tagged {
        k.push_str(rest);
    } else {
        k.push('{');
        k.push_str(bucket_key);
        k.push('}');
    }
    k
}

/// [`QuotaReport::demand_milli`] of a subscriber whose demand is not
/// measured yet (it has reported once: Envoy's first report of a bucket
/// follows its first request at once, so it measures nothing). The largest
/// integer a Lua number holds exactly, so the quota script keeps it as it
/// is; a measured demand is recorded at most one below it.
pub const UNMEASURED_DEMAND: u64 = (1 << 53) - 1;

/// The assignment a subscriber holds, in Envoy's token bucket terms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Held {
    /// Tokens added per fill interval.
    pub tokens_per_fill: u32,
    /// Tokens held at most.
    pub max_tokens: u32,
}

/// One bucket entry of a usage report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaReport {
    /// The rule's bucket key ([`super::key::encode`], prefix included).
    pub bucket: String,
    /// Its subscriber records ([`subscribers_key`]).
    pub subscribers: String,
    /// The allowed count as a consume with debt on the bucket (cost 0:
    /// nothing to charge).
    pub charge: ChargeSpec,
    /// The subscriber (replica id and stream id), at most 64 bytes.
    pub subscriber: String,
    /// Its smoothed demand, thousandths of a request a second
    /// ([`UNMEASURED_DEMAND`]: not measured yet). Storage keeps it as given.
    pub demand_milli: u64,
    /// The assignment it holds now (`None`: none yet, or a blanket rule);
    /// recorded as [`fit`] cuts it to `budget`.
    pub held: Option<Held>,
    /// The rule's budget over all subscribers (tokens per fill and max
    /// tokens): the recorded assignments never sum above it.
    pub budget: Held,
    /// A record not refreshed for this many milliseconds is dropped (and the
    /// records' key expires this long after the last report). 0: the
    /// subscriber leaves: its record alone is removed (the others are left
    /// as they are, stale ones included) and the entry's view lists no
    /// subscribers; the charge is made as for any entry.
    pub live_ms: u64,
}

/// One live subscriber of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriberRecord {
    /// Its id ([`QuotaReport::subscriber`]).
    pub id: String,
    /// Its smoothed demand, thousandths of a request a second
    /// ([`UNMEASURED_DEMAND`]: not measured yet).
    pub demand_milli: u64,
    /// The assignment it holds.
    pub held: Option<Held>,
}

/// What a report entry returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaView {
    /// The bucket's balance after the charge, micro-tokens (negative in debt).
    pub balance_micro: i64,
    /// Every live subscriber, the reporting one included, sorted by id.
    pub subscribers: Vec<SubscriberRecord>,
}

/// The max tokens of an assignment counted against the rule's burst: all
/// of them, but an assignment with a part of the rate that holds a single
/// token counts 0. That token is what it needs to use its rate at all (a
/// bucket that holds nothing admits nothing, whatever it refills), and
/// counting it would let small shares crowd the burst out: with a burst of
/// 6 among six Envoys, five idle ones holding one token each would leave
/// the busy one 1. So the held max tokens sum to at most the burst plus one
/// per subscriber with a part of the rate.
#[must_use]
pub fn max_against_burst(tokens_per_fill: u64, max_tokens: u64) -> u64 {
    if tokens_per_fill > 0 && max_tokens == 1 {
        0
    } else {
        max_tokens
    }
}

/// `held` cut, field by field, to what `others` leave of `budget`: what
/// storage records (and the quota script computes the same way). `others`
/// is the other live subscribers' recorded tokens per fill and their max
/// tokens counted by [`max_against_burst`]. An assignment left with a part
/// of the rate holds at least 1 max token (counted 0). `None` stays `None`
/// (it holds nothing).
#[must_use]
pub fn fit(held: Option<Held>, budget: Held, others: (u64, u64)) -> Option<Held> {
    let left = |total: u32, used: u64| u64::from(total).saturating_sub(used);
    held.map(|h| {
        let tokens_per_fill =
            u32::try_from(u64::from(h.tokens_per_fill).min(left(budget.tokens_per_fill, others.0)))
                .unwrap_or(u32::MAX);
        let max_tokens =
            u32::try_from(u64::from(h.max_tokens).min(left(budget.max_tokens, others.1)))
                .unwrap_or(u32::MAX);
        Held {
            tokens_per_fill,
            max_tokens: if tokens_per_fill > 0 {
                max_tokens.max(1)
            } else {
                max_tokens
            },
        }
    })
}

/// A subscriber record packed as stored: demand (8 bytes), tokens per fill
/// (4), max tokens (4), last report in microseconds (8), big-endian; held
/// fields `u32::MAX` for none.
#[must_use]
pub fn pack(demand_milli: u64, held: Option<Held>, seen_us: u64) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&demand_milli.to_be_bytes());
    let (t, m) = held.map_or((u32::MAX, u32::MAX), |h| (h.tokens_per_fill, h.max_tokens));
    out[8..12].copy_from_slice(&t.to_be_bytes());
    out[12..16].copy_from_slice(&m.to_be_bytes());
    out[16..].copy_from_slice(&seen_us.to_be_bytes());
    out
}

/// The inverse of [`pack`]: `(demand_milli, held, seen_us)`; `None` for a
/// value of another length.
#[must_use]
pub fn unpack(b: &[u8]) -> Option<(u64, Option<Held>, u64)> {
    if b.len() != 24 {
        return None;
    }
    let u64_at = |i: usize| {
        b.get(i..i + 8)
            .and_then(|s| s.try_into().ok())
            .map(u64::from_be_bytes)
    };
    let u32_at = |i: usize| {
        b.get(i..i + 4)
            .and_then(|s| s.try_into().ok())
            .map(u32::from_be_bytes)
    };
    let (t, m) = (u32_at(8)?, u32_at(12)?);
    let held = (t != u32::MAX).then_some(Held {
        tokens_per_fill: t,
        max_tokens: m,
    });
    Some((u64_at(0)?, held, u64_at(16)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let h = Some(Held {
            tokens_per_fill: 7,
            max_tokens: 9,
        });
        assert_eq!(unpack(&pack(5, h, 11)), Some((5, h, 11)));
        assert_eq!(unpack(&pack(0, None, 1)), Some((0, None, 1)));
        assert_eq!(unpack(b"short"), None);
    }

    #[test]
    fn the_one_token_of_a_rate_share_does_not_crowd_out_the_burst() {
        let budget = Held {
            tokens_per_fill: 41,
            max_tokens: 6,
        };
        let want = Some(Held {
            tokens_per_fill: 37,
            max_tokens: 6,
        });
        // Four others hold a part of the rate and their one token each:
        // counted 0 against the burst, so the busy one keeps all 6.
        let others = (4, 4 * max_against_burst(1, 1));
        assert_eq!(fit(want, budget, others), want);
        // Two tokens with a part of the rate count in full.
        assert_eq!(max_against_burst(1, 2), 2);
        assert_eq!(max_against_burst(0, 1), 1);
        // Others holding 5 counted tokens leave 1.
        let cut = fit(want, budget, (4, 5)).expect("held");
        assert_eq!((cut.tokens_per_fill, cut.max_tokens), (37, 1));
        // No rate left: no token either.
        let none = fit(want, budget, (41, 6)).expect("held");
        assert_eq!((none.tokens_per_fill, none.max_tokens), (0, 0));
    }

    #[test]
    fn subscriber_keys_sit_beside_the_bucket() {
        assert_eq!(
            subscribers_key("rls:", "rls:d4:edge|k1:a=v1:b"),
            "rls:q{rls:d4:edge|k1:a=v1:b}"
        );
        // A hash tag in the prefix is every key's: the name stays short.
        assert_eq!(
            subscribers_key("rls:{x}:", "rls:{x}:d4:edge|k1:a=v1:b"),
            "rls:{x}:qd4:edge|k1:a=v1:b"
        );
    }

    proptest::proptest! {
        /// Whatever the client sends (braces included) and with or without
        /// a hash tag in the prefix, the subscriber records land in their
        /// bucket's hash slot, and never on a bucket key.
        #[test]
        fn subscriber_keys_share_the_slot_of_their_bucket(
            prefix in proptest::sample::select(vec!["rls:", "", "t:{limits}:", "{a}b{c}:", "x}y{z}:"]),
            domain in "[a-z{}%|=:]{1,8}",
            entries in proptest::collection::vec(("[a-z_{}%|=:!#]{0,6}", "[a-z_{}%|=:!#]{0,80}", proptest::bool::ANY), 0..5),
            rate in proptest::option::of((1u32..1000, 1u64..86_400)),
        ) {
            use super::super::key::{KeyValue, encode, push_override_rate};
            use super::super::redis::cluster::key_slot;
            let e: Vec<(&str, KeyValue<'_>)> = entries
                .iter()
                .map(|(k, v, shared)| {
                    (k.as_str(), if *shared { KeyValue::Shared(v.as_str()) } else { KeyValue::Value(v.as_str()) })
                })
                .collect();
            let mut bucket = encode(prefix, &domain, &e);
            if let Some((n, unit)) = rate {
                push_override_rate(&mut bucket, n, unit);
            }
            let subs = subscribers_key(prefix, &bucket);
            proptest::prop_assert_eq!(key_slot(&subs), key_slot(&bucket), "{} {}", subs, bucket);
            proptest::prop_assert!(subs.starts_with(prefix));
            proptest::prop_assert_ne!(&subs, &bucket);
        }
    }
}
