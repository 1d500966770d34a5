//! The snapshot budget when no bandwidth is given: as many bytes a step as can go without
//! slowing the step — the "what the link carries in one step time without slowing it",
//! measured rather than assumed.
//!
//! Two things can make a round too big, and both are measured on every rank:
//!
//! * **the link**: a rank still has frames of the last round to write when the next step's
//!   all-reduce begins (it is *late*): the round did not fit in a step time;
//! * **the CPU**: the transports' threads spent more than [`SNAPSHOT_CPU_SHARE`] of the
//!   processes' CPU time on snapshot frames (copying, writing and reading them). On a host whose
//!   cores the training fills — a CPU run — every cycle a snapshot takes is one the step loses,
//!   and on loopback the link *is* the CPU. (Running the snapshot threads in the idle
//!   scheduling class did not keep their cost off the step on a 2-core VM: the copies compete
//!   for memory bandwidth and caches, and the reads run on the transport's reader threads.)
//!
//! The pace reacts to either as TCP's congestion control does (Jacobson 1988): it doubles from
//! one expert a round until a round is too big, then halves on every round that is and grows by
//! one expert a round otherwise — close below what fits, now and then finding out that the room
//! has grown.
//!
//! * Never below one expert a round (unless the link's cap is): even a saturated host keeps
//!   snapshotting its experts at risk, one a step, most tokens at risk first.
//! * Never above the link's cap (`bandwidth` × the mean step time), as with a given bandwidth.
//!
//! Every input is the same on every rank (the bytes a round sent follow from the shared
//! selection; lateness and CPU times are summed by the step's all-reduce), so every rank
//! computes the same budget.

/// The share of the workers' CPU time the snapshot tier may take by default: its threads' own
/// CPU time, measured (the copy into each frame, its write, and the read of its payload on the
/// receiver). Not metered: the frame headers' reads, the copy-on-write of optimizer moments a
/// queued copy still shares (on the training thread), the kernel's network work outside these
/// threads, and the memory bandwidth and caches the copies take from training. At 0.5% the
/// step-time overhead measured on a 2-core VM was within its noise (±3%).
pub const SNAPSHOT_CPU_SHARE: f64 = 0.005;

/// What the last round cost, summed over the ranks by the step's all-reduce.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoundCost {
    /// Ranks that still had frames of the last round to write when this step's all-reduce began.
    pub late_ranks: usize,
    /// CPU seconds the ranks' transports spent on snapshot frames over the last step.
    pub snapshot_cpu_s: f64,
    /// CPU seconds of the ranks' processes over the same time, snapshot threads included.
    pub process_cpu_s: f64,
}

impl RoundCost {
    /// Terms of the step's all-reduce a rank adds: 1 if it is late, its snapshot CPU seconds, its
    /// process's. The sums over the ranks give the job's cost ([`RoundCost::from_sums`]).
    pub const TERMS: usize = 3;

    /// This rank's terms ([`RoundCost::TERMS`] of them) for the all-reduce.
    pub fn terms(late: bool, snapshot_cpu_s: f64, process_cpu_s: f64) -> [f32; Self::TERMS] {
        [f32::from(u8::from(late)), snapshot_cpu_s as f32, process_cpu_s as f32]
    }

    /// The job's cost from the summed terms (the same bits on every rank).
    pub fn from_sums(sums: [f32; Self::TERMS]) -> Self {
        RoundCost {
            late_ranks: sums[0].round().max(0.0) as usize,
            snapshot_cpu_s: f64::from(sums[1]).max(0.0),
            process_cpu_s: f64::from(sums[2]).max(0.0),
        }
    }

    /// The share of the processes' CPU the snapshot frames took (0 with no CPU measured).
    pub fn cpu_share(&self) -> f64 {
        match self.process_cpu_s > 0.0 {
            true => (self.snapshot_cpu_s / self.process_cpu_s).max(0.0),
            false => 0.0,
        }
    }

    /// The round was too big: a rank was late, or the frames took more than
    /// [`SNAPSHOT_CPU_SHARE`] of the CPU.
    pub fn too_big(&self) -> bool {
        self.late_ranks > 0 || self.cpu_share() > SNAPSHOT_CPU_SHARE
    }
}

/// The adaptive budget's state over one epoch (a move starts a new one from its default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SnapshotPace {
    /// Bytes the last round sent.
    last_sent: u64,
    /// A round of this epoch was too big: grow by one expert a round instead of doubling.
    backed_off: bool,
}

impl SnapshotPace {
    /// This round's budget after a last round that cost `last`; `cap` is the link's bytes in a
    /// step time, `unit` one expert's state (the least worth sending).
    pub fn budget(&mut self, last: &RoundCost, cap: u64, unit: u64) -> u64 {
        self.next(last.too_big(), cap, unit)
    }

    /// [`SnapshotPace::budget`] once it is known whether the last round was too big.
    fn next(&mut self, too_big: bool, cap: u64, unit: u64) -> u64 {
        let sent = self.last_sent;
        let next = if too_big {
            self.backed_off = true;
            sent / 2
        } else if self.backed_off {
            sent.saturating_add(unit)
        } else {
            sent.saturating_mul(2)
        };
        next.max(unit).min(cap)
    }

    /// The bytes this round sent (what the selection took within the budget).
    pub fn sent(&mut self, bytes: u64) {
        self.last_sent = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A round of `budget` sends whole experts, no more than `need` (the bytes at risk).
    fn send(budget: u64, need: u64, unit: u64) -> u64 {
        (budget / unit * unit).min(need)
    }

    /// Rounds against a host that carries `room` bytes a step without slowing: a round is too big
    /// when it sent more. Returns (sent, late) of every round.
    fn run(rounds: usize, room: u64, need: u64, cap: u64, unit: u64) -> Vec<(u64, bool)> {
        let mut pace = SnapshotPace::default();
        let mut late = false;
        (0..rounds)
            .map(|_| {
                let sent = send(pace.next(late, cap, unit), need, unit);
                pace.sent(sent);
                late = sent > room;
                (sent, late)
            })
            .collect()
    }

    #[test]
    fn it_doubles_up_to_everything_at_risk_when_the_room_allows_and_is_never_late() {
        // 23 experts at risk (one unit each), room for 40 a step.
        let r = run(12, 40, 23, u64::MAX, 1);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 4, 8, 16, 23, 23, 23, 23, 23, 23, 23]);
        assert!(r.iter().all(|x| !x.1));
    }

    #[test]
    fn with_little_room_it_settles_between_half_of_it_and_it() {
        let r = run(400, 10, 23, u64::MAX, 1);
        let tail = &r[100..];
        assert!(tail.iter().all(|&(s, _)| (5..=11).contains(&s)), "{tail:?}");
        let late = tail.iter().filter(|x| x.1).count();
        // The sawtooth: late once every (room/2 + 1) rounds or so.
        assert!(late * 4 <= tail.len() && late > 0, "{late} of {}", tail.len());
        let mean = tail.iter().map(|x| x.0).sum::<u64>() as f64 / tail.len() as f64;
        assert!((7.0..=10.5).contains(&mean), "{mean}");
    }

    #[test]
    fn no_room_at_all_still_sends_one_expert_a_round_and_the_cap_bounds_everything() {
        let r = run(50, 0, 23, u64::MAX, 1);
        assert!(r[10..].iter().all(|&(s, late)| s == 1 && late), "{r:?}");
        // The link's cap (no step time measured yet: cap 0).
        let mut pace = SnapshotPace::default();
        assert_eq!(pace.next(false, 0, 3), 0);
        assert_eq!(pace.next(false, 2, 3), 2, "a cap below one expert sends none of them");
        pace.sent(90);
        assert_eq!(pace.next(false, 100, 3), 100);
    }

    #[test]
    fn a_round_is_too_big_when_a_rank_is_late_or_the_cpu_share_is_passed() {
        let cost = |late_ranks, snapshot_cpu_s, process_cpu_s| RoundCost { late_ranks, snapshot_cpu_s, process_cpu_s };
        assert!(!cost(0, SNAPSHOT_CPU_SHARE * 0.8, 1.0).too_big());
        assert!(cost(0, SNAPSHOT_CPU_SHARE * 1.2, 1.0).too_big(), "over the CPU share");
        assert!(cost(1, 0.0, 1.0).too_big(), "a late rank");
        assert_eq!(cost(0, 0.3, 0.0).cpu_share(), 0.0, "no CPU measured: no share");
        assert!((cost(0, 0.25, 2.0).cpu_share() - 0.125).abs() < 1e-12);
        // Three ranks' terms summed as the all-reduce does: one late, CPU added up.
        let ranks = [RoundCost::terms(false, 0.01, 1.0), RoundCost::terms(true, 0.02, 1.5), RoundCost::terms(false, 0.0, 0.5)];
        let sums = ranks.iter().fold([0.0f32; 3], |a, t| [a[0] + t[0], a[1] + t[1], a[2] + t[2]]);
        let job = RoundCost::from_sums(sums);
        assert_eq!(job.late_ranks, 1);
        assert!((job.snapshot_cpu_s - 0.03).abs() < 1e-6 && (job.process_cpu_s - 3.0).abs() < 1e-6, "{job:?}");
        let mut pace = SnapshotPace::default();
        pace.sent(40);
        assert_eq!(pace.budget(&job, 1000, 3), 20, "a late rank halves the budget");
    }

    proptest! {
        /// Within [min(unit, cap), cap] always; a late round never grows the budget past half of
        /// what it sent (or one expert); an on-time round never shrinks it below what it sent.
        #[test]
        fn bounded_and_monotone_in_lateness(
            history in proptest::collection::vec((0u64..1000, any::<bool>()), 0..20),
            sent in 0u64..1000,
            late in any::<bool>(),
            cap in 0u64..2000,
            unit in 1u64..50,
        ) {
            let mut pace = SnapshotPace::default();
            for (s, l) in history {
                pace.next(l, cap, unit);
                pace.sent(s);
            }
            pace.sent(sent);
            let b = pace.next(late, cap, unit);
            prop_assert!(b <= cap && b >= unit.min(cap));
            if late {
                prop_assert!(b <= (sent / 2).max(unit));
            } else {
                prop_assert!(b >= sent.min(cap));
            }
        }
    }
}
