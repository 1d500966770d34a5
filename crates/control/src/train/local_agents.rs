//! The node agents `train --workers N --gpus-per-node G` starts on this host, on loopback.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::AgentsSpec;
use crate::error::ControlError;
use crate::launcher::die_with_parent;
use crate::protocol::secret_hex;

/// Agent processes started on this host (`train --workers N --gpus-per-node G`).
pub(super) struct LocalAgents {
    children: Vec<std::process::Child>,
}

impl LocalAgents {
    pub(super) fn reap_within(&mut self, within: Duration) {
        let until = Instant::now() + within;
        for c in &mut self.children {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LocalAgents {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(super) fn start_local_agents(a: &AgentsSpec, controller: SocketAddr) -> Result<LocalAgents, ControlError> {
    let exe = std::env::current_exe().map_err(|e| ControlError::io("locating the lazarus binary", e))?;
    let mut agents = LocalAgents { children: Vec::with_capacity(a.local_agents) };
    for i in 0..a.local_agents {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["agent", "--controller", &controller.to_string(), "--gpus", &a.gpus_per_node.to_string()])
            .env("LAZARUS_SECRET", secret_hex(a.secret))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit());
        die_with_parent(&mut cmd);
        agents.children.push(cmd.spawn().map_err(|e| ControlError::io(format!("starting agent {i}"), e))?);
    }
    Ok(agents)
}
