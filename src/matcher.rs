//! The compiled descriptor tree and the matching walk (docs/design.md, "Matching descriptors"). Pure: no I/O.
//!
//! At each level the walk tries, in order: the child with the exact key and
//! value; the children whose value is a wildcard pattern, in config order; the
//! key-only child. It never backtracks to a sibling, and a rule applies only when
//! the request has exactly as many entries as the rule's path.

use std::collections::HashMap;

/// A wildcard pattern: `*` matches zero or more characters, anywhere, several allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    parts: Vec<String>,
}

impl Pattern {
    /// Compiles `text` (which should contain at least one `*`).
    #[must_use]
    pub fn new(text: &str) -> Self {
        Self {
            text: text.to_owned(),
            parts: text.split('*').map(str::to_owned).collect(),
        }
    }

    /// The pattern as written.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether `value` matches. Linear in `value.len()` times the number of parts.
    #[must_use]
    pub fn matches(&self, value: &str) -> bool {
        let parts = &self.parts;
        if parts.len() == 1 {
            return parts[0] == value;
        }
        let (first, last) = (&parts[0], &parts[parts.len() - 1]);
        if value.len() < first.len() + last.len()
            || !value.starts_with(first.as_str())
            || !value.ends_with(last.as_str())
        {
            return false;
        }
        let mut rest = &value[first.len()..value.len() - last.len()];
        for mid in &parts[1..parts.len() - 1] {
            match rest.find(mid.as_str()) {
                Some(i) => rest = &rest[i + mid.len()..],
                None => return false,
            }
        }
        true
    }
}

/// One level of the tree: children grouped by key.
#[derive(Debug, Clone, Default)]
pub struct Level {
    by_key: HashMap<String, KeyGroup>,
}

#[derive(Debug, Clone, Default)]
struct KeyGroup {
    exact: HashMap<String, Node>,
    wildcards: Vec<(Pattern, Node)>,
    key_only: Option<Box<Node>>,
}

/// A node: an optional rule (index into the domain's rules) and children.
#[derive(Debug, Clone, Default)]
pub struct Node {
    /// Index of the node's rule in `DomainConfig::rules`.
    pub rule: Option<usize>,
    /// For a wildcard node with `share_threshold`: all values share one bucket.
    pub share_threshold: bool,
    /// Where the node is defined (`file:line`), for errors.
    pub source: String,
    /// Next level.
    pub children: Level,
}

impl Node {
    fn offset_rules(&mut self, offset: usize) {
        if let Some(r) = &mut self.rule {
            *r += offset;
        }
        for n in self.children.nodes_mut() {
            n.offset_rules(offset);
        }
    }
}

/// How a node is selected at its level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// `key` with `value`.
    Exact(String),
    /// `key` with a wildcard `value`.
    Wildcard(Pattern),
    /// `key` without `value`.
    KeyOnly,
}

impl Level {
    /// Inserts a child; returns it for filling in. Duplicates must be rejected
    /// by the caller beforehand (an exact or key-only duplicate returns the
    /// existing node; a wildcard duplicate would be added again and never match).
    pub fn insert(&mut self, key: &str, sel: Selector) -> &mut Node {
        let g = self.by_key.entry(key.to_owned()).or_default();
        match sel {
            Selector::Exact(v) => g.exact.entry(v).or_default(),
            Selector::Wildcard(p) => {
                // Appended without a search: the loader rejects duplicate
                // siblings before inserting, so this stays linear in the
                // number of wildcard rules.
                g.wildcards.push((p, Node::default()));
                let n = g.wildcards.len() - 1;
                &mut g.wildcards[n].1
            }
            Selector::KeyOnly => g.key_only.get_or_insert_with(Box::default),
        }
    }

    /// Moves the top-level nodes of `other` into this level, adding
    /// `rule_offset` to every rule index below them (the rules of `other`'s
    /// domain are appended after this one's). A node of `other` whose key and
    /// value (or pattern, or key-only) this level already has is not moved:
    /// returned as `(selector text, source here, source in other)`.
    pub fn merge(&mut self, other: Level, rule_offset: usize) -> Vec<(String, String, String)> {
        let mut duplicates = Vec::new();
        for (key, group) in other.by_key {
            let mine = self.by_key.entry(key.clone()).or_default();
            for (value, mut node) in group.exact {
                if let Some(existing) = mine.exact.get(&value) {
                    duplicates.push((
                        format!("{key}_{value}"),
                        existing.source.clone(),
                        node.source.clone(),
                    ));
                    continue;
                }
                node.offset_rules(rule_offset);
                mine.exact.insert(value, node);
            }
            for (pattern, mut node) in group.wildcards {
                if let Some((_, existing)) = mine.wildcards.iter().find(|(p, _)| *p == pattern) {
                    duplicates.push((
                        format!("{key}_{}", pattern.as_str()),
                        existing.source.clone(),
                        node.source.clone(),
                    ));
                    continue;
                }
                node.offset_rules(rule_offset);
                mine.wildcards.push((pattern, node));
            }
            if let Some(mut node) = group.key_only {
                if let Some(existing) = &mine.key_only {
                    duplicates.push((key.clone(), existing.source.clone(), node.source.clone()));
                } else {
                    node.offset_rules(rule_offset);
                    mine.key_only = Some(node);
                }
            }
        }
        duplicates
    }

    fn nodes_mut(&mut self) -> impl Iterator<Item = &mut Node> {
        self.by_key.values_mut().flat_map(|g| {
            g.exact
                .values_mut()
                .chain(g.wildcards.iter_mut().map(|(_, n)| n))
                .chain(g.key_only.as_deref_mut())
        })
    }

    fn child(&self, key: &str, value: &str) -> Option<(&Node, Option<&str>)> {
        let g = self.by_key.get(key)?;
        if let Some(n) = g.exact.get(value) {
            return Some((n, None));
        }
        if let Some((p, n)) = g.wildcards.iter().find(|(p, _)| p.matches(value)) {
            return Some((n, n.share_threshold.then_some(p.as_str())));
        }
        g.key_only.as_deref().map(|n| (n, None))
    }
}

/// A successful match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched<'a> {
    /// Index of the rule in the domain's rule list.
    pub rule: usize,
    /// Per entry: `Some(pattern)` where the bucket is shared across values
    /// (`share_threshold`), `None` where the request's own value identifies it.
    pub shared: Vec<Option<&'a str>>,
}

/// Finds the rule for one request descriptor's entries `(key, value)`.
/// `None`: no rule at exactly this depth along the one path the walk takes.
#[must_use]
pub fn find<'a>(root: &'a Level, entries: &[(&str, &str)]) -> Option<Matched<'a>> {
    if entries.is_empty() {
        return None;
    }
    let mut level = root;
    let mut shared = Vec::with_capacity(entries.len());
    let mut node = None;
    for (k, v) in entries {
        let (n, s) = level.child(k, v)?;
        shared.push(s);
        level = &n.children;
        node = Some(n);
    }
    node?.rule.map(|rule| Matched { rule, shared })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pattern_semantics() {
        let p = Pattern::new("/api/*");
        assert!(p.matches("/api/"));
        assert!(p.matches("/api/x/y"));
        assert!(!p.matches("/api"));
        let p = Pattern::new("a*b*c");
        assert!(p.matches("abc"));
        assert!(p.matches("aXbYbZc"));
        assert!(!p.matches("ac"));
        assert!(!p.matches("abcb"));
        let p = Pattern::new("*");
        assert!(p.matches(""));
        let p = Pattern::new("ab*ba");
        assert!(!p.matches("aba"));
    }

    /// Obviously-correct glob: recursive backtracking over chars.
    fn glob_ref(p: &[char], v: &[char]) -> bool {
        match p.split_first() {
            None => v.is_empty(),
            Some(('*', rest)) => (0..=v.len()).any(|i| glob_ref(rest, &v[i..])),
            Some((c, rest)) => v.first() == Some(c) && glob_ref(rest, &v[1..]),
        }
    }

    /// Reference config: a list of (key, value-or-pattern-or-None, rule?, children).
    #[derive(Debug, Clone)]
    struct RefNode {
        key: String,
        value: Option<String>,
        rule: Option<usize>,
        children: Vec<RefNode>,
    }

    fn ref_find(nodes: &[RefNode], entries: &[(String, String)]) -> Option<usize> {
        let ((k, v), rest) = entries.split_first()?;
        let pick = nodes
            .iter()
            .find(|n| n.key == *k && n.value.as_deref() == Some(v.as_str()))
            .or_else(|| {
                nodes.iter().find(|n| {
                    n.key == *k
                        && n.value.as_ref().is_some_and(|p| {
                            p.contains('*')
                                && glob_ref(
                                    &p.chars().collect::<Vec<_>>(),
                                    &v.chars().collect::<Vec<_>>(),
                                )
                        })
                })
            })
            .or_else(|| nodes.iter().find(|n| n.key == *k && n.value.is_none()))?;
        if rest.is_empty() {
            pick.rule
        } else {
            ref_find(&pick.children, rest)
        }
    }

    fn build(level: &mut Level, nodes: &[RefNode]) {
        for n in nodes {
            let sel = match &n.value {
                None => Selector::KeyOnly,
                Some(v) if v.contains('*') => Selector::Wildcard(Pattern::new(v)),
                Some(v) => Selector::Exact(v.clone()),
            };
            let node = level.insert(&n.key, sel);
            node.rule = n.rule;
            build(&mut node.children, &n.children);
        }
    }

    fn dedup(nodes: Vec<RefNode>) -> Vec<RefNode> {
        let mut seen = std::collections::HashSet::new();
        nodes
            .into_iter()
            .filter(|n| seen.insert((n.key.clone(), n.value.clone())))
            .map(|mut n| {
                n.children = dedup(n.children);
                n
            })
            .collect()
    }

    fn arb_tree() -> impl Strategy<Value = Vec<RefNode>> {
        let leaf = (
            "[ab]",
            proptest::option::of("[xy*]{0,3}"),
            proptest::option::of(0usize..50),
        )
            .prop_map(|(key, value, rule)| RefNode {
                key,
                value,
                rule,
                children: vec![],
            });
        let node = leaf.prop_recursive(3, 24, 4, |inner| {
            (
                "[ab]",
                proptest::option::of("[xy*]{0,3}"),
                proptest::option::of(0usize..50),
                proptest::collection::vec(inner, 0..4),
            )
                .prop_map(|(key, value, rule, children)| RefNode {
                    key,
                    value,
                    rule,
                    children,
                })
        });
        proptest::collection::vec(node, 0..6).prop_map(dedup)
    }

    proptest! {
        #[test]
        fn matches_reference(tree in arb_tree(),
                             reqs in proptest::collection::vec(proptest::collection::vec(("[ab]", "[xy]{0,3}"), 0..4), 1..20)) {
            let mut root = Level::default();
            build(&mut root, &tree);
            for req in reqs {
                let entries: Vec<(&str, &str)> = req.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                prop_assert_eq!(find(&root, &entries).map(|m| m.rule), ref_find(&tree, &req));
            }
        }

        #[test]
        fn pattern_matches_reference(p in "[ab*]{0,6}", v in "[ab]{0,6}") {
            let pc: Vec<char> = p.chars().collect();
            let vc: Vec<char> = v.chars().collect();
            prop_assert_eq!(Pattern::new(&p).matches(&v), glob_ref(&pc, &vc));
        }
    }
}
