//! `--join-rule`, a flag of `lazarus controller` and `lazarus sim`: when a running job takes in
//! workers that joined ([`JoinRule`], the controller's).

use lazarus_controller::decisions::{JoinRule, REPAID_JOIN_AT_MOST};

/// When a running job takes in workers that joined (`--join-rule`, for `lazarus sim` and
/// `lazarus controller`): the controller's [`JoinRule`].
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinChoice {
    /// After the join wait (the paper's rule).
    Wait,
    /// Where moves come often, with the next one the job makes anyway (at most until waiting
    /// cost as much as a move).
    Repaid,
}

impl JoinChoice {
    pub fn rule(self) -> JoinRule {
        match self {
            JoinChoice::Wait => JoinRule::AfterWait,
            JoinChoice::Repaid => JoinRule::WhenRepaid { at_most: REPAID_JOIN_AT_MOST },
        }
    }
}
