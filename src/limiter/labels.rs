//! Bounds on metric labels that carry request values (`detailed_metric`,
//! `value_to_metric`): each value is clipped, and the number of distinct such
//! labels in the process is capped, so clients choosing values cannot grow
//! the exported series (or the recorder's memory) without bound.

use crate::metrics::RuleCounters;
use parking_lot::Mutex;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

/// Most distinct value-carrying labels in one process; later ones count
/// under `<rule path>._other`.
pub const MAX_VALUE_LABELS: usize = 10_000;

/// Most bytes of one request value in a label (cut on a character boundary).
pub const MAX_LABEL_VALUE_BYTES: usize = 64;

/// The value-carrying labels handed out so far, with their counters.
#[derive(Debug, Default)]
pub struct ValueLabels {
    seen: Mutex<Labels>,
}

#[derive(Debug, Default)]
struct Labels {
    /// At most [`MAX_VALUE_LABELS`].
    values: HashMap<String, Arc<RuleCounters>>,
    /// `<path>._other` by rule path (as many as rules with such labels).
    others: HashMap<String, Arc<RuleCounters>>,
}

impl ValueLabels {
    /// The counters of `label` if it was handed out before or there is room
    /// for it, else those of `<path>._other`.
    pub fn bounded(&self, path: &str, label: String) -> Arc<RuleCounters> {
        let mut seen = self.seen.lock();
        if let Some(c) = seen.values.get(&label) {
            return c.clone();
        }
        if seen.values.len() < MAX_VALUE_LABELS {
            let c = Arc::new(RuleCounters::new(label.clone()));
            seen.values.insert(label, c.clone());
            return c;
        }
        if let Some(c) = seen.others.get(path) {
            return c.clone();
        }
        let c = Arc::new(RuleCounters::new(format!("{path}._other")));
        seen.others.insert(path.to_owned(), c.clone());
        c
    }

    /// `value`, cut to at most [`MAX_LABEL_VALUE_BYTES`] bytes, with control
    /// characters (which would break a log line or a scraper) as `_`.
    #[must_use]
    pub fn clip(value: &str) -> Cow<'_, str> {
        let mut end = value.len().min(MAX_LABEL_VALUE_BYTES);
        while !value.is_char_boundary(end) {
            end -= 1;
        }
        let cut = &value[..end];
        if cut.chars().any(char::is_control) {
            Cow::Owned(
                cut.chars()
                    .map(|c| if c.is_control() { '_' } else { c })
                    .collect(),
            )
        } else {
            Cow::Borrowed(cut)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_past_the_cap_share_the_rules_other_label() {
        let l = ValueLabels::default();
        for i in 0..MAX_VALUE_LABELS {
            assert_eq!(
                l.bounded("d.k", format!("d.k_{i}")).label(),
                format!("d.k_{i}")
            );
        }
        assert_eq!(l.bounded("d.k", "d.k_new".into()).label(), "d.k._other");
        assert_eq!(l.bounded("d.k", "d.k_newer".into()).label(), "d.k._other");
        assert_eq!(l.seen.lock().others.len(), 1, "one _other label per rule");
        // Labels handed out before stay.
        assert_eq!(l.bounded("d.k", "d.k_7".into()).label(), "d.k_7");
    }

    #[test]
    fn long_values_are_clipped_on_a_character_boundary() {
        assert_eq!(ValueLabels::clip("short"), "short");
        let long = "é".repeat(40); // 80 bytes
        let clipped = ValueLabels::clip(&long);
        assert_eq!(clipped.len(), 64);
        assert!(long.starts_with(&*clipped));
        let odd = format!("a{}", "é".repeat(40));
        assert_eq!(ValueLabels::clip(&odd).len(), 63);
        assert_eq!(ValueLabels::clip("a\r\nb\0c\td"), "a__b_c_d");
    }
}
