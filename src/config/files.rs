//! Reading config sources: a file or a directory of `*.yaml` files, bounded
//! in size, hashed by name and content; [`load_source`] reads and compiles
//! ([`super::compile`]) in one step.

use super::compile::{LoadOptions, compile_texts_with};
use super::{Config, ConfigError, ConfigErrors};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// SHA-256 (hex) over `(file name, bytes)` pairs in name order. Only the last
/// component of each name counts, so the hash depends on the policy files and
/// not on where they are mounted or how the path was spelled:
/// `check-config config/` in CI and a pod reading `/etc/bucket-rls` agree.
#[must_use]
pub fn hash_files(files: &[(String, Vec<u8>)]) -> String {
    let mut sorted: Vec<(&str, &Vec<u8>)> = files
        .iter()
        .map(|(n, b)| {
            let base = Path::new(n)
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or(n);
            (base, b)
        })
        .collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = Sha256::new();
    for (name, bytes) in sorted {
        h.update((name.len() as u64).to_be_bytes());
        h.update(name.as_bytes());
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    }
    hex::encode(h.finalize())
}

/// Largest config file read, in bytes. A bigger file (or a device such as
/// `/dev/zero` behind a symlink) is an error, so reading stays bounded.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// Largest config source read, in bytes, all files together: parsing holds
/// every file's YAML tree at once (about 25 times the text), so many files
/// each under [`MAX_FILE_BYTES`] must not add up to more memory than one
/// file at the cap. Past it, the remaining files are errors (the source does
/// not load, and a running service keeps its config).
pub const MAX_SOURCE_BYTES: u64 = 64 << 20;

/// The files a source stands for: the file itself, or for a directory every
/// visible `*.yaml`/`*.yml` entry (symlinks followed; hidden entries such as
/// Kubernetes `..data` skipped, so a ConfigMap mount loads each file once),
/// sorted by name. Whether each is a readable regular file is checked when it
/// is read ([`read_source`]): a visible `*.yaml` entry that is a dangling
/// symlink, a FIFO or a device is an error, never silently skipped (skipping
/// it would drop its domain on reload).
///
/// # Errors
/// The source cannot be read.
pub fn source_files(source: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let io_err = |e: std::io::Error| ConfigError {
        file: source.display().to_string(),
        line: None,
        path: String::new(),
        message: format!("cannot read: {e}"),
    };
    let meta = std::fs::metadata(source).map_err(io_err)?;
    if !meta.is_dir() {
        return Ok(vec![source.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(source).map_err(io_err)? {
        let entry = entry.map_err(io_err)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
            continue;
        }
        let path = entry.path();
        // A visible directory named *.yaml is not a config file; anything else
        // (regular file, symlink, FIFO, device) is read and checked.
        if std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        files.push(path);
    }
    files.sort();
    Ok(files)
}

/// Reads one config file: opened without blocking (a FIFO cannot hang the
/// loader), checked to be a regular file, and read up to [`MAX_FILE_BYTES`].
///
/// # Errors
/// A message saying what is wrong with the file.
pub fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file (a FIFO, socket or device cannot be a config file)".into());
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!(
            "too large: {} bytes (at most {MAX_FILE_BYTES})",
            meta.len()
        ));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("too large: more than {MAX_FILE_BYTES} bytes"));
    }
    Ok(bytes)
}

/// Reads every file of `source` (a file or a directory, with the rules of
/// [`source_files`]) as `(name, bytes)`, without parsing.
///
/// # Errors
/// The source or one of its files cannot be read.
pub fn read_source(source: &Path) -> Result<Vec<(String, Vec<u8>)>, ConfigErrors> {
    let (texts, errors) = read_source_partly(source)?;
    if errors.is_empty() {
        Ok(texts)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// Files read, as `(name, bytes)`.
type Texts = Vec<(String, Vec<u8>)>;

/// [`read_source`] that goes on past files it cannot read: the files read,
/// and one error per file that could not be.
///
/// # Errors
/// The source itself cannot be read.
fn read_source_partly(source: &Path) -> Result<(Texts, Vec<ConfigError>), ConfigErrors> {
    let files = source_files(source).map_err(|e| ConfigErrors(vec![e]))?;
    let mut texts = Vec::with_capacity(files.len());
    let mut errors = Vec::new();
    let mut total: u64 = 0;
    for f in &files {
        let name = f.display().to_string();
        match read_file(f) {
            Ok(bytes) if total + bytes.len() as u64 > MAX_SOURCE_BYTES => {
                errors.push(ConfigError {
                    file: name,
                    line: None,
                    path: String::new(),
                    message: format!(
                        "the config source is too large: this file ({} bytes) takes the files read so far past {MAX_SOURCE_BYTES} bytes in all; split the policy across services or shrink it",
                        bytes.len()
                    ),
                });
                // Counted, so every later file is refused too and the
                // bytes held stay under the cap.
                total = MAX_SOURCE_BYTES;
            }
            Ok(bytes) => {
                total += bytes.len() as u64;
                texts.push((name, bytes));
            }
            Err(message) => errors.push(ConfigError {
                file: name,
                line: None,
                path: String::new(),
                message,
            }),
        }
    }
    Ok((texts, errors))
}

/// Loads a file or directory into a complete [`Config`].
///
/// # Errors
/// Every problem of every file, plus duplicate domains across files: a file
/// that cannot be read does not hide the problems of the others.
pub fn load_source(source: &Path) -> Result<Config, ConfigErrors> {
    load_source_with(source, LoadOptions::default())
}

/// [`load_source`] with `options`.
///
/// # Errors
/// As [`load_source`]; with `merge_domains`, a top-level descriptor defined
/// in two files of one domain instead of a duplicate domain.
pub fn load_source_with(source: &Path, options: LoadOptions) -> Result<Config, ConfigErrors> {
    let (texts, mut errors) = read_source_partly(source)?;
    match compile_texts_with(&texts, options) {
        Ok(config) if errors.is_empty() => Ok(config),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(more)) => {
            errors.extend(more);
            errors.sort_by(|a, b| a.file.cmp(&b.file));
            Err(ConfigErrors(errors))
        }
    }
}
