//! Checkpoints: weights and optimizer state as safetensors (loadable by PyTorch / Hugging Face
//! tools) plus a JSON manifest (step, data cursor, configuration, per-tensor optimizer steps).
//!
//! A checkpoint is written into a temporary directory, every file fsynced, the directory renamed
//! to `step-XXXXXXXX`, and only then the `latest` pointer replaced (write, fsync, rename), so a
//! crash at any moment leaves the previous checkpoint intact and `latest` pointing at a
//! complete one. The manifest holds each tensor file's length and CRC-32, checked on load, and a
//! tensor that is not finite is never saved; a damaged newest checkpoint gives way to the newest
//! intact one ([`load_intact`]) — of the same run: a directory belongs to one run (`run` names
//! it), a new run sets the old one's checkpoints aside ([`start_run`]), a fallback never
//! crosses runs, and a resume from an older checkpoint sets the newer ones aside, saying so,
//! before it can write over them ([`set_aside_newer`]). Temporary directories a failed write
//! left behind are removed by the next save.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

pub const FORMAT_VERSION: u32 = 1;
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const LATEST_FILE: &str = "latest";
/// The file naming the run a checkpoint directory belongs to.
pub const RUN_FILE: &str = "run";

/// Everything a checkpoint holds besides tensors. `extra` is the trainer's own state (config,
/// cursor, …) as JSON, so this module does not depend on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub step: u64,
    /// Parameter names in model order.
    pub params: Vec<String>,
    /// AdamW step count of each parameter, same order.
    pub optimizer_steps: Vec<u64>,
    pub extra: serde_json::Value,
    /// Length and CRC-32 of each tensor file, filled in by [`save`] (absent in checkpoints
    /// written before they were kept: those load unchecked).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, FileSum>,
    /// The run that wrote it (absent in checkpoints written before runs were named).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
}

/// What a tensor file must be to be the one that was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    pub bytes: u64,
    pub crc32: u32,
}

impl FileSum {
    pub fn of(bytes: &[u8]) -> Self {
        FileSum { bytes: bytes.len() as u64, crc32: crc32fast::hash(bytes) }
    }
}

pub struct CheckpointData {
    pub manifest: Manifest,
    pub weights: HashMap<String, Tensor>,
    /// `m/{name}` and `v/{name}` moments.
    pub optimizer: HashMap<String, Tensor>,
    pub path: PathBuf,
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| ModelError::io(path, e))?;
    f.write_all(bytes).map_err(|e| ModelError::io(path, e))?;
    f.sync_all().map_err(|e| ModelError::io(path, e))
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path).and_then(|d| d.sync_all()).map_err(|e| ModelError::io(path, e))
}

/// Refuse a tensor with a NaN or an infinity: a diverged run must not become the checkpoint a
/// resume trusts.
fn check_finite(tensors: &[(String, Tensor)], path: &Path) -> Result<()> {
    for (name, t) in tensors {
        let values: Vec<f32> = t.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            return Err(ModelError::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("tensor {name} holds a non-finite value ({} at {i}): not saved", values[i]),
            });
        }
    }
    Ok(())
}

/// Temporary directories of writes whose process is gone (a crash, a kill mid-write).
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(pid) = name.strip_prefix(".tmp-step-").and_then(|r| r.rsplit('-').next()).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn serialize(tensors: &[(String, Tensor)], path: &Path) -> Result<Vec<u8>> {
    let mut sorted: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    safetensors::serialize(sorted, None).map_err(|e| ModelError::Checkpoint { path: path.to_path_buf(), reason: e.to_string() })
}

/// Write a checkpoint under `dir` and point `dir/latest` at it, then remove all but the newest
/// `keep` checkpoints (0: keep every one). Returns its directory.
pub fn save(dir: &Path, manifest: &Manifest, weights: &[(String, Tensor)], optimizer: &[(String, Tensor)], keep: usize) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    remove_stale_temporaries(dir);
    check_finite(weights, dir)?;
    check_finite(optimizer, dir)?;
    let name = format!("step-{:08}", manifest.step);
    let tmp = dir.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    let mut manifest = manifest.clone();
    for (file, tensors) in [(MODEL_FILE, weights), (OPTIMIZER_FILE, optimizer)] {
        let bytes = serialize(tensors, &tmp)?;
        manifest.files.insert(file.to_string(), FileSum::of(&bytes));
        write_synced(&tmp.join(file), &bytes)?;
    }
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| ModelError::Checkpoint { path: tmp.clone(), reason: e.to_string() })?;
    write_synced(&tmp.join(MANIFEST_FILE), &json)?;
    sync_dir(&tmp)?;
    let target = dir.join(&name);
    if target.exists() {
        // Re-saving the same step (e.g. after a resume): the new one replaces it.
        std::fs::remove_dir_all(&target).map_err(|e| ModelError::io(&target, e))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| ModelError::io(&target, e))?;
    sync_dir(dir)?;
    let latest_tmp = dir.join(format!(".{LATEST_FILE}.tmp-{}", std::process::id()));
    write_synced(&latest_tmp, name.as_bytes())?;
    std::fs::rename(&latest_tmp, dir.join(LATEST_FILE)).map_err(|e| ModelError::io(dir.join(LATEST_FILE), e))?;
    sync_dir(dir)?;
    if keep > 0 {
        // Oldest first out; never the one `latest` now names.
        let mut saved = step_dirs(dir)?;
        saved.sort_by_key(|s| std::cmp::Reverse(s.0));
        for (_, path) in saved.into_iter().filter(|(_, p)| *p != target).skip(keep.saturating_sub(1)) {
            std::fs::remove_dir_all(&path).map_err(|e| ModelError::io(&path, e))?;
        }
    }
    Ok(target)
}

/// The `step-N` checkpoint directories in `dir`, with their steps.
fn step_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    Ok(std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            Some((step, e.path()))
        })
        .collect())
}

/// The checkpoint of a run `dir` holds (or is), by name, if it holds one: `latest`'s — or, where
/// `latest` is missing (a crash between writing a checkpoint and naming it, an operator's
/// mistake), the newest `step-*` directory. A directory that holds one is a run to go on with
/// (`--resume` finds its newest intact checkpoint: [`load_intact`]), never one to start over in.
pub fn held_checkpoint(dir: &Path) -> Option<String> {
    if dir.join(MANIFEST_FILE).exists() {
        return Some(format!("{} itself", dir.file_name()?.to_string_lossy()));
    }
    if let Ok(name) = std::fs::read_to_string(dir.join(LATEST_FILE)) {
        return Some(name.trim().to_string());
    }
    let newest = step_dirs(dir).ok()?.into_iter().max_by_key(|(step, _)| *step)?;
    Some(format!("{} (no `latest`)", newest.1.file_name()?.to_string_lossy()))
}

/// The run directory a run resumed from `dir` goes on writing in: `dir`'s parent when `dir` is
/// one of a run's `step-N` checkpoints (its parent names a run or a latest checkpoint) — so
/// that `--resume --checkpoint-dir ck/step-N` goes on in `ck`, with the checkpoints after step N
/// set aside, not in new directories nested inside the checkpoint — else `dir`.
pub fn run_dir_of(dir: &Path) -> PathBuf {
    let is_step = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-")).is_some_and(|n| n.parse::<u64>().is_ok());
    match dir.parent() {
        Some(parent)
            if is_step && dir.join(MANIFEST_FILE).exists() && (parent.join(RUN_FILE).exists() || parent.join(LATEST_FILE).exists()) =>
        {
            parent.to_path_buf()
        }
        _ => dir.to_path_buf(),
    }
}

/// The checkpoint `dir/latest` points at, or `dir` itself if it is a checkpoint directory.
pub fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(dir.to_path_buf());
    }
    let latest = dir.join(LATEST_FILE);
    let name = std::fs::read_to_string(&latest).map_err(|e| ModelError::io(&latest, e))?;
    let name = name.trim();
    if name.is_empty() || name.contains('/') || name.contains("..") {
        return Err(ModelError::Checkpoint { path: latest, reason: format!("does not name a checkpoint: {name:?}") });
    }
    Ok(dir.join(name))
}

/// The step of the checkpoint `dir/latest` points at (None: none there, or unreadable).
pub fn latest_step(dir: &Path) -> Option<u64> {
    let manifest = std::fs::read(resolve(dir).ok()?.join(MANIFEST_FILE)).ok()?;
    serde_json::from_slice::<Manifest>(&manifest).ok().map(|m| m.step)
}

pub fn load(dir: &Path, device: &Device) -> Result<CheckpointData> {
    let path = resolve(dir)?;
    let bad = |reason: String| ModelError::Checkpoint { path: path.clone(), reason };
    let text = std::fs::read(path.join(MANIFEST_FILE)).map_err(|e| ModelError::io(path.join(MANIFEST_FILE), e))?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| bad(format!("manifest: {e}")))?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(bad(format!("format version {} (this build reads {FORMAT_VERSION})", manifest.format_version)));
    }
    if manifest.params.len() != manifest.optimizer_steps.len() {
        return Err(bad("manifest: params and optimizer_steps differ in length".into()));
    }
    let read = |file: &str| -> Result<HashMap<String, Tensor>> {
        let bytes = std::fs::read(path.join(file)).map_err(|e| ModelError::io(path.join(file), e))?;
        if let Some(want) = manifest.files.get(file) {
            let got = FileSum::of(&bytes);
            if got != *want {
                return Err(bad(format!(
                    "{file} is damaged: {} bytes with CRC-32 {:08x}, the manifest says {} bytes with {:08x}",
                    got.bytes, got.crc32, want.bytes, want.crc32
                )));
            }
        }
        candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| bad(format!("{file}: {e}")))
    };
    let weights = read(MODEL_FILE)?;
    let optimizer = read(OPTIMIZER_FILE)?;
    Ok(CheckpointData { manifest, weights, optimizer, path })
}

/// The checkpoint to resume from in `dir`: `latest`'s, or — if it is missing or damaged — the
/// newest `step-*` that loads, with why each newer one was passed over. A checkpoint directory
/// given itself is loaded as it is (no fallback: the user named it).
pub fn load_intact(dir: &Path, device: &Device) -> Result<(CheckpointData, Vec<String>)> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok((load(dir, device)?, Vec::new()));
    }
    let first = match load(dir, device) {
        Ok(ck) => return Ok((ck, Vec::new())),
        Err(e) => e,
    };
    let latest = resolve(dir).ok();
    let mut older: Vec<(u64, PathBuf)> = step_dirs(dir)?.into_iter().filter(|(_, p)| Some(p) != latest.as_ref()).collect();
    older.sort_by_key(|o| std::cmp::Reverse(o.0));
    let mut passed = vec![format!("{}: {first}", latest.as_deref().unwrap_or(&dir.join(LATEST_FILE)).display())];
    // A fallback stays within the directory's run: another run's checkpoint is no older state
    // of this one.
    let run = dir_run(dir);
    for (_, path) in older {
        let written_by = manifest_run(&path);
        if run.is_some() && written_by != run {
            passed.push(format!(
                "{}: written by run {}, not this directory's run {}",
                path.display(),
                written_by.as_deref().unwrap_or("(unnamed)"),
                run.as_deref().unwrap_or_default()
            ));
            continue;
        }
        match load(&path, device) {
            Ok(ck) => return Ok((ck, passed)),
            Err(e) => passed.push(format!("{}: {e}", path.display())),
        }
    }
    Err(ModelError::Checkpoint { path: dir.to_path_buf(), reason: format!("no intact checkpoint: {}", passed.join("; ")) })
}

/// The run `dir` belongs to (its `run` file), if it names one.
pub fn dir_run(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(RUN_FILE)).ok()?;
    let run = text.trim();
    (!run.is_empty()).then(|| run.to_string())
}

/// The run that wrote the checkpoint at `path`, read from its manifest alone.
fn manifest_run(path: &Path) -> Option<String> {
    let text = std::fs::read(path.join(MANIFEST_FILE)).ok()?;
    serde_json::from_slice::<Manifest>(&text).ok()?.run
}

/// A fresh run id: 16 hex digits from the operating system's random source.
pub fn fresh_run_id() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).map_err(|e| ModelError::io("/dev/urandom", e))?;
    Ok(format!("{:016x}", u64::from_le_bytes(b)))
}

/// Seconds since the epoch, for the names of directories set aside.
fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Move `names` of `dir` into `dir/aside` (created), keeping their names.
fn move_aside(dir: &Path, names: &[PathBuf], aside: &Path) -> Result<()> {
    std::fs::create_dir_all(aside).map_err(|e| ModelError::io(aside, e))?;
    for path in names {
        let Some(name) = path.file_name() else { continue };
        std::fs::rename(path, aside.join(name)).map_err(|e| ModelError::io(path, e))?;
    }
    sync_dir(aside)?;
    sync_dir(dir)
}

/// Make `dir` run `run`'s: the checkpoints of a run that wrote there before (its `step-*`,
/// `latest` and `run`) move into `dir/previous-runs/RUN-SECONDS/` — nothing is deleted, and
/// nothing of the old run can be taken for the new one's. Returns where they went, if anywhere.
pub fn start_run(dir: &Path, run: &str) -> Result<Option<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut old: Vec<PathBuf> = step_dirs(dir)?.into_iter().map(|(_, p)| p).collect();
    for file in [LATEST_FILE, RUN_FILE] {
        if dir.join(file).exists() {
            old.push(dir.join(file));
        }
    }
    let aside = if old.is_empty() {
        None
    } else {
        let previous = dir_run(dir).unwrap_or_else(|| "unnamed".to_string());
        let aside = dir.join("previous-runs").join(format!("{previous}-{}", now_s()));
        move_aside(dir, &old, &aside)?;
        Some(aside)
    };
    let tmp = dir.join(format!(".{RUN_FILE}.tmp-{}", std::process::id()));
    write_synced(&tmp, run.as_bytes())?;
    std::fs::rename(&tmp, dir.join(RUN_FILE)).map_err(|e| ModelError::io(dir.join(RUN_FILE), e))?;
    sync_dir(dir)?;
    Ok(aside)
}

/// A run resumed from its checkpoint of `step`: its checkpoints of later steps (newer than the
/// one it goes on from: `latest` pointed back, or a damaged newest passed over) would be
/// written over as it trains again; they move into `dir/superseded/after-step-N-SECONDS/`
/// first, and `latest` names the checkpoint resumed from. Returns what moved.
pub fn set_aside_newer(dir: &Path, step: u64) -> Result<Vec<PathBuf>> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(Vec::new()); // a checkpoint directory named itself: nothing to set aside
    }
    let newer: Vec<PathBuf> = step_dirs(dir)?.into_iter().filter(|(s, _)| *s > step).map(|(_, p)| p).collect();
    if newer.is_empty() {
        return Ok(newer);
    }
    let aside = dir.join("superseded").join(format!("after-step-{step:08}-{}", now_s()));
    move_aside(dir, &newer, &aside)?;
    let latest_tmp = dir.join(format!(".{LATEST_FILE}.tmp-{}", std::process::id()));
    write_synced(&latest_tmp, format!("step-{step:08}").as_bytes())?;
    std::fs::rename(&latest_tmp, dir.join(LATEST_FILE)).map_err(|e| ModelError::io(dir.join(LATEST_FILE), e))?;
    sync_dir(dir)?;
    Ok(newer.iter().filter_map(|p| p.file_name()).map(|n| aside.join(n)).collect())
}
