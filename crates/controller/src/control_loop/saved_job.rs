//! The controller's state file: what a new controller needs to take a running job back after
//! this one is lost (`lazarus controller --resume-job`). Written atomically (a temporary file,
//! fsync, rename, fsync of the directory) whenever the job's epoch changes, before any worker is
//! told of the new epoch — so the file is never behind what a worker may have heard. Removed
//! when the job completes.
//!
//! What it keeps and why: the job's id (agents re-attach to the same job), its plan, ranks and
//! nodes at the newest epoch, the last checkpoint and step logged, and the numbers given out to
//! workers and agents (newcomers are numbered after them). What it does not keep, because the
//! workers report it again when their agents re-attach: where each worker stopped, what it
//! holds, its snapshots. The job's settings (model, data, training) and the workers it was
//! started with are kept too, so that a new controller runs the job as it was and refuses a
//! flag that would change it (or another job's state found in the directory); the loads for
//! the next rebalance are measured anew.

use lazarus_setting::Setting;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::decisions::JobState;
use lazarus_protocol::ControlError;

/// The format name the file carries.
pub const SAVED_JOB_FORMAT: &str = "lazarus-job-state/1";
/// The state file's name in the checkpoint directory.
pub const SAVED_JOB_FILE: &str = "controller-state.json";
/// Largest state file read (a plan of 64 ranks x 256 experts x 64 layers is well under this).
const MOST_BYTES: u64 = 64 << 20;

/// A running job as its controller saved it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SavedJob {
    pub format: String,
    pub job_id: String,
    /// Workers (GPUs) of every node.
    pub gpus_per_node: usize,
    /// Agent numbers given out so far.
    pub agents: u64,
    /// When it was written, milliseconds since the Unix epoch.
    pub saved_unix_ms: u64,
    pub state: JobState,
    /// The job's settings (absent from files of earlier versions).
    #[serde(default)]
    pub config: Option<lazarus_model::TrainConfig>,
    /// The workers it was started with (`--workers`; it may have more or fewer now).
    #[serde(default)]
    pub launched_workers: Option<usize>,
}

impl SavedJob {
    pub fn new(job_id: &str, gpus_per_node: usize, agents: u64, state: JobState) -> Self {
        let saved_unix_ms = lazarus_protocol::when::unix_ms_now();
        SavedJob {
            format: SAVED_JOB_FORMAT.into(),
            job_id: job_id.into(),
            gpus_per_node,
            agents,
            saved_unix_ms,
            state,
            config: None,
            launched_workers: None,
        }
    }

    /// With the job's settings and the workers it was started with.
    pub fn with_job(self, config: lazarus_model::TrainConfig, launched_workers: usize) -> Self {
        SavedJob { config: Some(config), launched_workers: Some(launched_workers), ..self }
    }

    /// Worker ids given out so far (every worker the job had has a node).
    pub fn workers(&self) -> usize {
        self.state.node_of.iter().map(|&(w, _)| w as usize + 1).max().unwrap_or(0)
    }

    /// The state file of a job checkpointing into `dir`.
    pub fn path_in(dir: &Path) -> PathBuf {
        dir.join(SAVED_JOB_FILE)
    }

    /// Read and check the state file at `path`.
    pub fn read(path: &Path) -> Result<Self, ControlError> {
        let bad = |reason: String| ControlError::invalid(Setting::ResumeJob, format!("{}: {reason}", path.display()));
        let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => bad(format!(
                "no saved job here: the job completed, never ran with node agents, or checkpoints into another {}",
                Setting::CheckpointDir
            )),
            _ => bad(e.to_string()),
        })?;
        if meta.len() > MOST_BYTES {
            return Err(bad(format!("{} bytes, more than the {MOST_BYTES} a saved job takes", meta.len())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let saved: SavedJob = serde_json::from_str(&text).map_err(|e| bad(format!("not a saved job ({e})")))?;
        if saved.format != SAVED_JOB_FORMAT {
            return Err(bad(format!("format {:?} (expected {SAVED_JOB_FORMAT:?})", saved.format)));
        }
        if saved.gpus_per_node == 0 || saved.workers() > lazarus_protocol::MAX_WORKERS * 64 {
            return Err(bad(format!("{} workers of nodes of {}", saved.workers(), saved.gpus_per_node)));
        }
        Ok(saved)
    }

    /// Write it to `path` atomically: a reader finds the old file or the new one, whole.
    pub fn write(&self, path: &Path) -> Result<(), ControlError> {
        let io = |what: &str, e: std::io::Error| ControlError::io(format!("{what} {}", path.display()), e);
        let tmp = path.with_extension("json.tmp");
        let json = serde_json::to_vec(self)?;
        let mut f = std::fs::File::create(&tmp).map_err(|e| io("writing", e))?;
        f.write_all(&json).map_err(|e| io("writing", e))?;
        f.sync_all().map_err(|e| io("syncing", e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io("renaming into", e))?;
        if let Some(dir) = path.parent() {
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> JobState {
        JobState {
            first_epoch: 5,
            epoch: 7,
            plan: "{}".into(),
            ranks: vec![0, 1, 4, 5],
            node_of: vec![(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)],
            checkpoint: Some(20),
            last_step: 23,
            reconfigurations: 2,
        }
    }

    #[test]
    fn a_saved_job_is_written_whole_and_read_back() {
        let dir = std::env::temp_dir().join(format!("lazarus-saved-job-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = SavedJob::path_in(&dir);
        let saved = SavedJob::new("job-1", 2, 3, state()).with_job(lazarus_model::TrainConfig { lr: 0.5, ..Default::default() }, 4);
        saved.write(&path).unwrap();
        assert_eq!(SavedJob::read(&path).unwrap(), saved);
        // A file of an earlier version, without the settings, still reads.
        let mut old = serde_json::to_value(&saved).unwrap();
        old.as_object_mut().unwrap().retain(|k, _| k != "config" && k != "launched_workers");
        std::fs::write(&path, old.to_string()).unwrap();
        assert_eq!(SavedJob::read(&path).unwrap(), SavedJob { config: None, launched_workers: None, ..saved.clone() });
        assert_eq!(saved.workers(), 6);
        assert!(!path.with_extension("json.tmp").exists());
        // What is not a saved job is refused, naming the flag and the file.
        for (text, why) in [("{", "not a saved job"), (r#"{"format":"x"}"#, "not a saved job")] {
            std::fs::write(&path, text).unwrap();
            let e = SavedJob::read(&path).unwrap_err().to_string();
            assert!(e.contains(&Setting::ResumeJob.to_string()) && e.contains(why), "{e}");
        }
        let mut other = serde_json::to_value(&saved).unwrap();
        other["format"] = "lazarus-job-state/9".into();
        std::fs::write(&path, other.to_string()).unwrap();
        assert!(SavedJob::read(&path).unwrap_err().to_string().contains("format"));
        std::fs::remove_file(&path).unwrap();
        assert!(SavedJob::read(&path).unwrap_err().to_string().contains("no saved job here"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
