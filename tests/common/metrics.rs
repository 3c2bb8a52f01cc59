//! Reading the process-wide Prometheus metrics in tests.

/// The process-wide metrics, rendered now.
pub fn scrape() -> String {
    bucket_rls::metrics::install().render()
}

/// The value of the series `name{labels}` in Prometheus text `text` (labels
/// must match exactly, in any order); `None` when the series is absent.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    want.sort();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (n, got) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let mut got: Vec<String> = if got.is_empty() {
                Vec::new()
            } else {
                got.split(',').map(str::to_owned).collect()
            };
            got.sort();
            (got == want).then(|| value.parse().ok()).flatten()
        })
}

/// Like [`metric`] on a fresh scrape, with an absent series read as 0.
pub fn counter(name: &str, labels: &[(&str, &str)]) -> f64 {
    metric(&scrape(), name, labels).unwrap_or(0.0)
}

/// Number of series (sample lines) of metric family `name` in `text`.
pub fn series_count(text: &str, name: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split(['{', ' ']).next().is_some_and(|n| {
                n == name || n.strip_prefix(name).is_some_and(|s| s.starts_with('_'))
            })
        })
        .count()
}
