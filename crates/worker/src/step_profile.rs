//! `LAZARUS_WORKER_PROFILE=DIR`, a diagnostic: each worker profiles its own steps
//! ([`lazarus_model::profile`]: wall, CPU and — on a GPU — CUDA-event time by phase and scope,
//! the GPU's phases synchronised at their edges) and adds one JSON line per step to
//! `DIR/worker-<pid>.jsonl`. It says where a distributed step's time goes: the forward, the
//! backward, the gradients' copies and all-reduce, the update, the commit vote, and inside them
//! the transport, the copies to and from the host, the router and the experts.

use std::io::Write;
use std::path::Path;

use candle_core::Device;
use lazarus_model::profile;
use serde_json::json;

/// The environment variable naming the directory the profiles go to.
pub const WORKER_PROFILE_ENV: &str = "LAZARUS_WORKER_PROFILE";

pub(crate) struct StepProfiler {
    file: std::fs::File,
    device: Device,
}

impl StepProfiler {
    /// A profiler when the environment asks for one (None otherwise, or when its file cannot be
    /// made: said once, and the worker trains on unprofiled).
    pub(crate) fn from_env(device: &Device) -> Option<Self> {
        let dir = std::env::var_os(WORKER_PROFILE_ENV).filter(|d| !d.is_empty())?;
        let path = Path::new(&dir).join(format!("worker-{}.jsonl", std::process::id()));
        let opened = std::fs::create_dir_all(&dir).and_then(|_| std::fs::OpenOptions::new().create(true).append(true).open(&path));
        match opened {
            Ok(file) => Some(StepProfiler { file, device: device.clone() }),
            Err(e) => {
                tracing::warn!("{WORKER_PROFILE_ENV}: cannot write {}: {e}; steps are not profiled", path.display());
                None
            }
        }
    }

    /// Clear what was added and profile the next step.
    pub(crate) fn start(&self) {
        profile::enable_on(&self.device);
    }

    /// The step's scopes, as one line; profiling stops until the next [`StepProfiler::start`].
    pub(crate) fn finish(&mut self, rank: usize, step: u64, seconds: f64) {
        let scopes: Vec<serde_json::Value> = profile::totals()
            .into_iter()
            .map(|((phase, scope), t)| {
                json!({
                    "phase": phase,
                    "scope": if scope == profile::WHOLE_PHASE { "(phase)" } else { scope },
                    "calls": t.calls,
                    "wall_s": t.wall.as_secs_f64(),
                    "gpu_s": t.gpu.as_secs_f64(),
                    "thread_cpu_s": t.thread_cpu.as_secs_f64(),
                })
            })
            .collect();
        profile::enable(false);
        let line = json!({ "pid": std::process::id(), "rank": rank, "step": step, "step_s": seconds, "scopes": scopes });
        if let Err(e) = writeln!(self.file, "{line}") {
            tracing::warn!("{WORKER_PROFILE_ENV}: {e}");
        }
    }
}
