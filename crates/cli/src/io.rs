//! Reading what the user names and writing what the user asked for, with errors that name the
//! flag and the file, and bounds on everything read (a path to `/dev/zero` is an error, not an
//! endless read).

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Largest JSON input (plans, loads, routing and load traces) read from a file.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// The one size check of everything that allocates a model or a layer (`train`, `bench train`,
/// `bench moe-layer`): refuse `need` bytes beyond the memory this process may use — the
/// machine's, or less where `ulimit -v` or a cgroup (a container, a Slurm job) sets a limit —
/// before anything is allocated, naming `what` needs them, the bound, and the flags that lower
/// it (not a `memory allocation failed` abort, or the OOM killer, half-way).
pub fn check_memory(need: u128, what: &str, lower: &str) -> Result<()> {
    if let Some((have, bound)) = lazarus_agent::launcher::memory_available() {
        if need > have as u128 {
            let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
            bail!("{what} needs about {:.1} GiB and {} {:.1} GiB: lower {lower}", gib(need), bound.says(), gib(have as u128));
        }
    }
    Ok(())
}

/// The text of `path`, given with `--{flag}`, at most `max` bytes, from a regular file only: a
/// FIFO would block (its open waits for a writer) and a device may never end (`/dev/zero`), so
/// both are refused, naming the flag.
pub fn read_text(flag: &str, path: &Path, max: u64) -> Result<String> {
    let file = open_regular(flag, path)?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).with_context(|| format!("--{flag}: cannot read {}", path.display()))?;
    if bytes.len() as u64 > max {
        let limit = if max >= 1 << 20 { format!("{} MiB", max >> 20) } else { format!("{max} bytes") };
        bail!("invalid --{flag}: {} is larger than {limit}", path.display());
    }
    String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("invalid --{flag}: {} is not UTF-8 text (byte {})", path.display(), e.utf8_error().valid_up_to()))
}

/// `path` opened for reading, if it is a regular file (opened without blocking, then checked:
/// a FIFO's open does not wait for a writer).
pub fn open_regular(flag: &str, path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("--{flag}: cannot read {}", path.display()))?;
    let meta = file.metadata().with_context(|| format!("--{flag}: cannot read {}", path.display()))?;
    if !meta.is_file() {
        bail!("invalid --{flag}: {} is not a regular file (a FIFO, a device or a directory)", path.display());
    }
    Ok(file)
}

/// JSON of type `T` from `path`, given with `--{flag}`.
pub fn read_json<T: serde::de::DeserializeOwned>(flag: &str, path: &Path) -> Result<T> {
    let text = read_text(flag, path, MAX_JSON_BYTES)?;
    serde_json::from_str(&text).with_context(|| format!("invalid --{flag}: {} is not valid", path.display()))
}

/// Write `text` to stdout; a full disk or a closed pipe is an error naming stdout, not a panic.
pub fn print(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|_| out.flush()).context("cannot write to stdout")
}

/// [`print`] with a newline.
pub fn println(text: &str) -> Result<()> {
    print(&format!("{text}\n"))
}

/// The job's secret from `path` (32 hex digits), or a fresh one written there (mode 0600).
pub fn secret_from_file(path: &Path, create: bool) -> Result<u128> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            let secret = lazarus_protocol::fresh_secret().context("drawing the job secret")?;
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let mut f = options.open(path).with_context(|| format!("creating --secret-file {}", path.display()))?;
            use std::io::Write;
            writeln!(f, "{}", lazarus_protocol::secret_hex(secret)).with_context(|| format!("writing {}", path.display()))?;
            Ok(secret)
        }
        _ => {
            // A regular file of a line (a FIFO or /dev/zero is refused, not read without end).
            let text = read_text("secret-file", path, 4096)?;
            lazarus_protocol::parse_secret(text.trim()).ok_or_else(|| {
                anyhow::anyhow!(
                    "invalid --secret-file {}: expected 32 hex digits drawn at random (at least 6 different ones)",
                    path.display()
                )
            })
        }
    }
}
