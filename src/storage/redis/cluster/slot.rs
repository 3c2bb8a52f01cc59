//! Hash slots: which of the 16,384 slots of a Redis Cluster a key lives in
//! (CRC16 of the key, or of its hash tag, as Redis computes it).

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16_384;

/// The hash slot of `key` (CRC16/XMODEM of the key, or of its hash tag, modulo
/// 16,384), as Redis Cluster computes it. Keys made by
/// [`key::encode`](crate::storage::key::encode) never contain a hash tag from
/// client text; a `{tag}` in the configured key prefix applies to every key.
#[must_use]
pub fn key_slot(key: &str) -> u16 {
    key_slot_bytes(key.as_bytes())
}

/// [`key_slot`] of a key that may not be UTF-8 (a key found by `SCAN`).
pub(crate) fn key_slot_bytes(b: &[u8]) -> u16 {
    crc16_xmodem(hash_tag(b).unwrap_or(b)) % SLOTS
}

/// The hash tag of `key`, as Redis Cluster finds it: the text between the
/// first `{` and the first `}` after it, when that text is not empty; a key
/// without one is hashed whole.
#[must_use]
pub fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|c| *c == b'{')?;
    let close = key[open + 1..].iter().position(|c| *c == b'}')?;
    (close > 0).then(|| &key[open + 1..open + 1 + close])
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in data {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::redis::cluster_routing::{Route, Slot, SlotAddr};

    #[test]
    fn slots_match_the_redis_crate() {
        for k in [
            "",
            "a",
            "rls:d3:api|k5:group=v7:reports",
            "x{tag}y",
            "{}x",
            "a{b",
            "pre{fix}:d1:x",
            "{user1000}.following",
        ] {
            assert_eq!(
                Route::new(key_slot(k), SlotAddr::Master),
                Route::with_slot(Slot::for_key(k), SlotAddr::Master),
                "{k}"
            );
        }
        // Known values from the Redis Cluster specification.
        assert_eq!(key_slot("123456789"), 0x31C3 % SLOTS);
        assert_eq!(key_slot("foo"), 12182);
    }

    #[test]
    fn escaped_client_braces_do_not_form_a_tag() {
        use crate::storage::key::{KeyValue, encode};
        let k = encode("rls:", "d", &[("k", KeyValue::Value("{x}"))]);
        assert_eq!(key_slot(&k), crc16_xmodem(k.as_bytes()) % SLOTS, "{k}");
    }
}
