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

/// A match of an unordered entry set ([`find_unordered`]): the rule, and
/// the entries in the order the walk took them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnorderedMatch<'a> {
    /// The rule and the per-entry sharing, in [`UnorderedMatch::order`].
    pub matched: Matched<'a>,
    /// Indices into the entries given, in the order the walk used them.
    pub order: Vec<usize>,
}

/// Finds the rule for an *unordered* set of entries `(key, value)` (an
/// Envoy quota `BucketId`, a map): the tree guides the order. At each level
/// the walk looks at the entries not used yet whose key that level knows
/// and whose value one of its children takes (exact value, then wildcards
/// in config order, then key-only, as [`find`] does); when several do, it
/// takes the one whose key sorts first (byte order). It never backtracks.
/// The rule applies when every entry was used and the node reached has a
/// rule (the depth matches). Keys are expected to be distinct (a map).
/// Linear in the depth times the number of entries.
#[must_use]
pub fn find_unordered<'a>(root: &'a Level, entries: &[(&str, &str)]) -> Option<UnorderedMatch<'a>> {
    if entries.is_empty() {
        return None;
    }
    let mut used = vec![false; entries.len()];
    let mut order = Vec::with_capacity(entries.len());
    let mut shared = Vec::with_capacity(entries.len());
    let mut level = root;
    let mut node = None;
    for _ in 0..entries.len() {
        let mut best: Option<(usize, &Node, Option<&str>)> = None;
        for (i, (k, v)) in entries.iter().enumerate() {
            if used[i] || best.is_some_and(|(b, _, _)| entries[b].0 <= *k) {
                continue;
            }
            if let Some((n, s)) = level.child(k, v) {
                best = Some((i, n, s));
            }
        }
        let (i, n, s) = best?;
        used[i] = true;
        order.push(i);
        shared.push(s);
        level = &n.children;
        node = Some(n);
    }
    let rule = node?.rule?;
    Some(UnorderedMatch {
        matched: Matched { rule, shared },
        order,
    })
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

    /// Reference of the unordered walk: at each level, of the unused
    /// entries the level takes, the one with the smallest key.
    fn ref_find_unordered(nodes: &[RefNode], entries: &[(String, String)]) -> Option<usize> {
        let mut remaining: Vec<(String, String)> = entries.to_vec();
        remaining.sort();
        let mut level = nodes;
        let mut rule = None;
        while !remaining.is_empty() {
            let pos = remaining.iter().position(|e| {
                let probe = [e.clone()];
                ref_pick(level, &probe[0]).is_some()
            })?;
            let e = remaining.remove(pos);
            let n = ref_pick(level, &e)?;
            rule = n.rule;
            level = &n.children;
        }
        rule
    }

    fn ref_pick<'a>(nodes: &'a [RefNode], (k, v): &(String, String)) -> Option<&'a RefNode> {
        nodes
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
            .or_else(|| nodes.iter().find(|n| n.key == *k && n.value.is_none()))
    }

    #[test]
    fn unordered_follows_the_tree() {
        let mut root = Level::default();
        let tenant = root.insert("tenant", Selector::Exact("acme".into()));
        tenant.rule = Some(0);
        let route = tenant.children.insert("route", Selector::KeyOnly);
        route.rule = Some(1);
        // Given in any order, the tree decides: tenant first, then route.
        let m = find_unordered(&root, &[("route", "/a"), ("tenant", "acme")]).expect("match");
        assert_eq!(m.matched.rule, 1);
        assert_eq!(m.order, vec![1, 0]);
        assert_eq!(
            find_unordered(&root, &[("tenant", "acme")]).map(|m| m.matched.rule),
            Some(0)
        );
        // An entry the walk cannot use: no rule.
        assert!(find_unordered(&root, &[("tenant", "acme"), ("x", "y")]).is_none());
        assert!(find_unordered(&root, &[]).is_none());
    }

    proptest! {
        #[test]
        fn unordered_matches_reference(tree in arb_tree(),
                             reqs in proptest::collection::vec(proptest::collection::btree_map("[abc]", "[xy]{0,3}", 0..4), 1..20)) {
            let mut root = Level::default();
            build(&mut root, &tree);
            for req in reqs {
                let owned: Vec<(String, String)> = req.into_iter().collect();
                let entries: Vec<(&str, &str)> = owned.iter().rev().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let got = find_unordered(&root, &entries);
                prop_assert_eq!(got.as_ref().map(|m| m.matched.rule), ref_find_unordered(&tree, &owned));
                if let Some(m) = got {
                    // The order found, given to the ordered walk, finds the same rule.
                    let ordered: Vec<(&str, &str)> = m.order.iter().map(|&i| entries[i]).collect();
                    prop_assert_eq!(find(&root, &ordered).map(|x| x.rule), Some(m.matched.rule));
                }
            }
        }

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
