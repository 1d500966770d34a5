//! What node agents relay between the controller and the workers, typed: a worker's reports up
//! ([`reports`]: the agent reads the worker's line and sends it on as protobuf) and the
//! controller's messages down ([`orders`]: protobuf to the agent, which checks them and hands
//! each worker its line). The controller encodes and decodes protobuf only; what comes in from
//! the other side is checked here once and refused naming the field.

pub mod orders;
pub mod reports;
pub mod start;

/// Why a message relayed by an agent is not one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("a relayed message's {field}: {reason}")]
pub struct BadMessage {
    pub field: &'static str,
    pub reason: String,
}

fn bad(field: &'static str, reason: impl Into<String>) -> BadMessage {
    BadMessage { field, reason: reason.into() }
}

/// A count from the wire as this machine's word.
fn word(field: &'static str, n: u64) -> Result<usize, BadMessage> {
    usize::try_from(n).map_err(|_| bad(field, format!("{n} is beyond this machine's words")))
}

fn ids(list: &[usize]) -> crate::proto::Ids {
    crate::proto::Ids { ids: list.iter().map(|&x| x as u64).collect() }
}

fn words(field: &'static str, list: &[u64]) -> Result<Vec<usize>, BadMessage> {
    list.iter().map(|&x| word(field, x)).collect()
}
