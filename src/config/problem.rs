//! How a config problem is named: where (the file and line, the descriptor
//! path with its selectors quoted and cut) and, for an unknown key, the
//! known key it nearly is. Used by the compiler for every error it reports.

/// A line position in any of the shapes the compiler meets: a known line
/// (0 for none), or an optional one.
pub(super) trait Line {
    /// The line, when there is one.
    fn line(self) -> Option<u32>;
}

impl Line for u32 {
    fn line(self) -> Option<u32> {
        Some(self)
    }
}

impl Line for u64 {
    fn line(self) -> Option<u32> {
        u32::try_from(self).ok()
    }
}

impl Line for i32 {
    fn line(self) -> Option<u32> {
        u32::try_from(self).ok()
    }
}

impl Line for Option<u32> {
    fn line(self) -> Option<u32> {
        self
    }
}

/// `file:line`, or `file` for a tree without lines.
pub(super) fn source_of(file: &str, line: Option<u32>) -> String {
    match line {
        Some(l) => format!("{file}:{l}"),
        None => file.to_owned(),
    }
}

/// Most characters of a descriptor's key or of its value that an error path
/// shows ([`descriptor_path`]), escapes included; a longer one is cut there
/// and marked with `…`.
pub const MAX_PATH_TEXT_CHARS: usize = 64;

/// The path of the descriptor at `index` of the list at `list`, naming what
/// is known of it: `descriptors[1](key=user, value=gold)`, a key-only
/// descriptor `descriptors[1](key=user)`, one without a key
/// `descriptors[1](value=gold)`, one with neither `descriptors[1]`. `list` is
/// `descriptors` at the top and the parent's path plus `.descriptors` below
/// it, so every level of a nested path names its own key and value.
///
/// The same builder serves file loads, `check-config` (files and xDS dumps)
/// and pushed xDS resources, so an error reads alike in the log, a NACK and
/// `/rlconfig`. Key and value are operator text: each shows at most
/// [`MAX_PATH_TEXT_CHARS`] characters, and one that is empty or holds
/// anything but letters, digits and ASCII punctuation other than `(),='"\`
/// (a space, a control character, an invisible one) is shown quoted and
/// escaped, as Rust's `{:?}` writes it (`value=""`, `value="a b"`).
#[must_use]
pub fn descriptor_path(list: &str, index: usize, key: Option<&str>, value: Option<&str>) -> String {
    let mut out = format!("{list}[{index}]");
    let parts: Vec<String> = [("key", key), ("value", value)]
        .into_iter()
        .filter_map(|(name, text)| text.map(|t| format!("{name}={}", path_text(t))))
        .collect();
    if !parts.is_empty() {
        out.push('(');
        out.push_str(&parts.join(", "));
        out.push(')');
    }
    out
}

/// `text` as [`descriptor_path`] shows it: plain, or quoted and escaped as
/// `{:?}` writes it; at most [`MAX_PATH_TEXT_CHARS`] characters inside the
/// quotes, escapes included, then `…` where it was cut.
fn path_text(text: &str) -> String {
    let plain = !text.is_empty()
        && text.chars().all(|c| {
            c.is_alphanumeric()
                || (c.is_ascii_punctuation()
                    && !matches!(c, '(' | ')' | ',' | '=' | '"' | '\'' | '\\'))
        });
    let (mut shown, mut width, mut cut) = (String::new(), 0, false);
    for c in text.chars() {
        // `{:?}` of a string escapes as a char's `escape_debug`, except `'`.
        let piece: String = if plain || c == '\'' {
            c.into()
        } else {
            c.escape_debug().collect()
        };
        let w = piece.chars().count();
        if width + w > MAX_PATH_TEXT_CHARS {
            cut = true;
            break;
        }
        width += w;
        shown.push_str(&piece);
    }
    let mut out = if plain { shown } else { format!("\"{shown}\"") };
    if cut {
        out.push('…');
    }
    out
}

/// The key of `known` nearest to `name` when it is a near miss: at most two
/// single-character edits (insert, delete, replace, or swap of neighbours)
/// and fewer than half of `name`'s characters, ties to the first in `known`.
pub(super) fn nearest<'k>(name: &str, known: &[&'k str]) -> Option<&'k str> {
    /// Optimal string alignment distance (Damerau-Levenshtein without
    /// overlapping edits), on bytes: config keys are ASCII.
    fn distance(a: &[u8], b: &[u8]) -> usize {
        let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
        for (i, row) in d.iter_mut().enumerate() {
            row[0] = i;
        }
        for (j, cell) in d[0].iter_mut().enumerate() {
            *cell = j;
        }
        for i in 1..=a.len() {
            for j in 1..=b.len() {
                let cost = usize::from(a[i - 1] != b[j - 1]);
                let mut v = (d[i - 1][j] + 1)
                    .min(d[i][j - 1] + 1)
                    .min(d[i - 1][j - 1] + cost);
                if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                    v = v.min(d[i - 2][j - 2] + 1);
                }
                d[i][j] = v;
            }
        }
        d[a.len()][b.len()]
    }
    // Keys are short; a long unknown name is no near miss and not worth
    // the quadratic table.
    if name.len() > 64 {
        return None;
    }
    let lower = name.to_ascii_lowercase();
    known
        .iter()
        .map(|k| (distance(lower.as_bytes(), k.as_bytes()), *k))
        .filter(|(d, _)| *d <= 2 && *d * 2 < name.len())
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}
