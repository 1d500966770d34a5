//! One rank's send and receive buffers, derived from the shared schedule.

use super::DispatchSchedule;
use crate::error::PlanError;

/// One rank's side of the padding-free all-to-all (Algorithm 1, lines 11–16): which of its
/// token slots go to which rank, and how the buffers it receives are laid out. Derived from the
/// shared [`DispatchSchedule`] alone, so senders and receivers agree without more messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLayout {
    /// `send[dst]`: this rank's token slots (index into its routed assignments, token-major
    /// `token·k + j`) sent to `dst`, grouped by expert in ascending order, token order within an
    /// expert. `send[me]` are the slots processed locally.
    pub send: Vec<Vec<u32>>,
    /// `send_experts[dst][i]`: the expert of `send[dst][i]`.
    pub send_experts: Vec<Vec<u32>>,
    /// `recv[src][e]`: how many slots of expert e arrive from `src` — consecutive, in ascending
    /// expert order, within the buffer from `src`.
    pub recv: Vec<Vec<u64>>,
}

impl RankLayout {
    /// Lay out rank `me`'s slots. `choices[i]` is the expert of slot i (token-major, k per
    /// token), exactly the assignments counted in the schedule's T[·][me].
    pub fn new(schedule: &DispatchSchedule, me: usize, choices: &[u32]) -> Result<Self, PlanError> {
        let (experts, ranks) = (schedule.experts(), schedule.ranks());
        if me >= ranks {
            return Err(PlanError::invalid("rank", me, format!("the schedule has {ranks} ranks")));
        }
        // Slots of each expert, in token order.
        let mut by_expert: Vec<Vec<u32>> = vec![Vec::new(); experts];
        for (slot, &e) in choices.iter().enumerate() {
            let e = e as usize;
            if e >= experts {
                return Err(PlanError::invalid("choices", e, format!("expert ids must be below {experts}")));
            }
            by_expert[e].push(slot as u32);
        }
        let mut send = vec![Vec::new(); ranks];
        let mut send_experts = vec![Vec::new(); ranks];
        let mut recv = vec![vec![0u64; experts]; ranks];
        for (e, slots) in by_expert.iter().enumerate() {
            let mut next = 0usize;
            let mut sent = 0u64;
            for r in schedule.routes(e) {
                let (src, dst) = (r.src as usize, r.dst as usize);
                if dst == me {
                    recv[src][e] += r.tokens;
                }
                if src != me {
                    continue;
                }
                // Line 16: the next D[e][me][dst] slots of e, in rank order of dst.
                let n = r.tokens as usize;
                let Some(chunk) = slots.get(next..next + n) else {
                    return Err(PlanError::invalid(
                        "choices",
                        format!("{} slots of expert {e}", slots.len()),
                        "fewer than the schedule dispatches from this rank",
                    ));
                };
                send[dst].extend_from_slice(chunk);
                send_experts[dst].extend(std::iter::repeat_n(e as u32, n));
                next += n;
                sent += r.tokens;
            }
            if sent as usize != slots.len() {
                return Err(PlanError::invalid(
                    "choices",
                    format!("{} slots of expert {e}", slots.len()),
                    format!("the schedule dispatches {sent} from rank {me}"),
                ));
            }
        }
        Ok(RankLayout { send, send_experts, recv })
    }
}
