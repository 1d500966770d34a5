//! The controller's decisions (the `lazarus-decide` crate, a pure function of state, event and
//! time) over the workers' own record of a committed step: the types the controller process's
//! loop feeds and reads.

/// Lists of ids as people read them (`0, 2, 4–9`).
pub use lazarus_decide::words;
pub use lazarus_decide::{
    BadJobState, JobSpec, JobState, JoinRule, LayerCase, MemberState, MoveCause, MoveCost, MoveDecision, NodeId, OnLoss, RankTransfer,
    RebalanceCase, RebalanceDecision, RebalanceVerdict, RestoredExpert, SnapshotHeld, Weighed, Weighing, REPAID_JOIN_AT_MOST,
};

use lazarus_protocol::CommittedStep;

pub type Controller = lazarus_decide::Controller<CommittedStep>;
pub type Event = lazarus_decide::Event<CommittedStep>;
pub type Command = lazarus_decide::Command<CommittedStep>;
pub type StopReport = lazarus_decide::StopReport<CommittedStep>;
