//! What each side of an agent's session proves with the job's secret (HMAC over a challenge,
//! [`lazarus_comm::auth`]): the words bound into each proof, so a proof for one node or one
//! agent number cannot be replayed as another's.

use crate::proto::AgentHello;

/// What an agent's hello proves, besides the job's secret: the node it describes.
pub fn hello_context(hello: &AgentHello) -> Vec<u8> {
    let mut context = format!("lazarus agent hello: {} gpus at {} (pid {})", hello.gpus, hello.host, hello.pid);
    if let Some(r) = &hello.rejoin {
        context.push_str(&format!(
            "; rejoins job {:?} as agent {} with workers from {} at epochs {:?}, {} ms without a controller",
            r.job_id, r.agent, r.first_worker, r.epochs, r.orphaned_ms
        ));
    }
    context.into_bytes()
}

/// What the controller's welcome proves: the agent's number in the job.
pub fn welcome_context(agent: u64) -> Vec<u8> {
    format!("lazarus controller welcome: agent {agent}").into_bytes()
}
