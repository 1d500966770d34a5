//! The flexible token dispatcher's schedule (paper §4.2, Algorithm 1).
//!
//! Every rank all-gathers T[e][j] (tokens routed to expert e on rank j) and knows R[e][j]
//! (replicas of e on rank j). From these alone it computes the same integer matrix
//! D[e][src][dst] as every other rank, so send and receive sizes of the padding-free all-to-all
//! agree without another message.
//!
//! For each expert:
//! 1. Capacity: rank j should process t_e · R[e][j] / r_e tokens (line 4–6). We apportion t_e
//!    over the ranks by largest remainder, so integer capacities C_j sum to t_e and each is
//!    within one token of its ideal; a rank with k replicas gets k shares.
//! 2. Local tokens use local capacity first (line 7–8): D[e][j][j] = min(T[e][j], C_j).
//! 3. The excess X_i = T[e][i] − D[e][i][i] of each sender is split over the residual capacities
//!    P_j = C_j − D[e][j][j] in proportion (line 10, with the denominator Σ_{k≠i} P_k taken over
//!    ranks other than the *sender* — DESIGN.md's erratum; since a rank with excess has no residual
//!    capacity, that is Σ_k P_k). The ideal X_i·P_j/ΣP is rounded to floor or ceil so that *both*
//!    every row sums to X_i (tokens are conserved) and every column to P_j (every replica gets
//!    exactly its capacity): floors first, then the remaining units are matched sender→receiver
//!    on cells with a fractional part, largest fractions first, completed by augmenting paths.
//!    Such a rounding always exists because the fractional matrix is a feasible flow.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;

/// Per-expert, per-rank token counts as all-gathered before dispatch: `tokens[e][rank]`.
pub type TokenCounts = Vec<Vec<u64>>;

/// One non-zero entry of D: `tokens` tokens routed to `expert` on `src` are processed on `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    pub expert: u32,
    pub src: u32,
    pub dst: u32,
    pub tokens: u64,
}

/// The integer matrix D[e][src][dst], stored sparsely in (expert, src, dst) order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchSchedule {
    experts: usize,
    ranks: usize,
    routes: Vec<Route>,
    /// routes of expert e are `routes[start[e]..start[e + 1]]`.
    start: Vec<usize>,
}

impl DispatchSchedule {
    /// Compute D from the all-gathered token counts and the replica counts R[e][rank]
    /// (Algorithm 1: every replica of an expert takes an equal share of its tokens).
    pub fn compute(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<Self, PlanError> {
        Self::build(tokens, replicas, false)
    }

    /// Like [`DispatchSchedule::compute`], but an expert's tokens are shared over its holders so
    /// that the ranks' *total* loads are as even as the holder sets allow (see
    /// [`balanced_capacities`]), instead of equally per replica. With integer replica counts on
    /// few slots, per-replica shares leave a rank holding 3 of 9 replicas of a hot expert with
    /// 1.33× the mean work; this removes that. Everything after the capacities is Algorithm 1.
    pub fn compute_balanced(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<Self, PlanError> {
        Self::build(tokens, replicas, true)
    }

    fn build(tokens: &[Vec<u64>], replicas: &[Vec<u32>], balanced: bool) -> Result<Self, PlanError> {
        let experts = tokens.len();
        if replicas.len() != experts {
            return Err(PlanError::Length { field: "replicas", got: replicas.len(), expected: experts });
        }
        let ranks = tokens.first().map_or(0, Vec::len);
        for (e, (t, r)) in tokens.iter().zip(replicas).enumerate() {
            if t.len() != ranks {
                return Err(PlanError::Length { field: "tokens", got: t.len(), expected: ranks });
            }
            if r.len() != ranks {
                return Err(PlanError::Length { field: "replicas", got: r.len(), expected: ranks });
            }
            if t.iter().try_fold(0u64, |acc, &x| acc.checked_add(x)).is_none_or(|total| total > u64::MAX / 2) {
                return Err(PlanError::invalid("tokens", format!("expert {e}"), "token counts overflow"));
            }
            if r.iter().all(|&x| x == 0) && t.iter().any(|&x| x > 0) {
                return Err(PlanError::invalid("replicas", format!("expert {e}"), "tokens are routed to an expert that has no replica"));
            }
        }
        // Rank loads add up over experts (balancing, per-rank totals): bound the grand total too.
        if tokens.iter().flatten().try_fold(0u64, |acc, &x| acc.checked_add(x)).is_none_or(|total| total > u64::MAX / 2) {
            return Err(PlanError::invalid("tokens", "all experts", "token counts overflow"));
        }
        let mut routes = Vec::with_capacity(experts * ranks * 2);
        let mut start = Vec::with_capacity(experts + 1);
        let mut scratch = Scratch::default();
        let caps = if balanced { Some(balanced_capacities(tokens, replicas)) } else { None };
        for e in 0..experts {
            start.push(routes.len());
            let total: u64 = tokens[e].iter().sum();
            scratch.cap.resize(ranks, 0);
            match &caps {
                Some(c) => scratch.cap.copy_from_slice(&c[e]),
                None => {
                    let Scratch { rems, cap, .. } = &mut scratch;
                    apportion_into(total, &replicas[e], rems, cap);
                }
            }
            expert_routes(e as u32, &tokens[e], &mut scratch, &mut routes);
        }
        start.push(routes.len());
        Ok(DispatchSchedule { experts, ranks, routes, start })
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Non-zero entries of D for one expert, ordered by (src, dst).
    pub fn routes(&self, expert: usize) -> &[Route] {
        &self.routes[self.start[expert]..self.start[expert + 1]]
    }

    /// All non-zero entries, ordered by (expert, src, dst).
    pub fn all_routes(&self) -> &[Route] {
        &self.routes
    }

    /// D[e][src][dst].
    pub fn get(&self, expert: usize, src: usize, dst: usize) -> u64 {
        self.routes(expert).iter().find(|r| r.src as usize == src && r.dst as usize == dst).map_or(0, |r| r.tokens)
    }

    /// s_j of Algorithm 1 for sender `src`: tokens it sends to each rank (itself included).
    pub fn send_counts(&self, src: usize) -> Vec<u64> {
        let mut out = vec![0; self.ranks];
        self.routes.iter().filter(|r| r.src as usize == src).for_each(|r| out[r.dst as usize] += r.tokens);
        out
    }

    /// Tokens rank `dst` receives from each rank (itself included).
    pub fn recv_counts(&self, dst: usize) -> Vec<u64> {
        let mut out = vec![0; self.ranks];
        self.routes.iter().filter(|r| r.dst as usize == dst).for_each(|r| out[r.src as usize] += r.tokens);
        out
    }

    /// Tokens each rank processes in total (its expert compute load).
    pub fn processed_per_rank(&self) -> Vec<u64> {
        let mut out = vec![0; self.ranks];
        self.routes.iter().for_each(|r| out[r.dst as usize] += r.tokens);
        out
    }

    /// Dense D[e][src][dst], for tests and small diagnostics.
    pub fn dense(&self) -> Vec<Vec<Vec<u64>>> {
        let mut d = vec![vec![vec![0; self.ranks]; self.ranks]; self.experts];
        for r in &self.routes {
            d[r.expert as usize][r.src as usize][r.dst as usize] += r.tokens;
        }
        d
    }
}

/// Capacities C[e][rank] (tokens of expert e that rank processes) with Σ_rank C[e] = Σ T[e],
/// C[e][j] = 0 where e has no replica on j, and the ranks' totals Σ_e C[e][j] as even as the
/// holder sets allow. Starts from the per-replica apportionment, then repeatedly moves half the
/// gap from an expert's most loaded holder to its least loaded one; every move lowers Σ_j L_j²,
/// so it ends, and it stops after a bounded number of passes. Deterministic in its inputs, so
/// every rank computes the same capacities without talking.
pub fn balanced_capacities(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Vec<Vec<u64>> {
    let ranks = tokens.first().map_or(0, Vec::len);
    let mut rems = Vec::new();
    let mut caps: Vec<Vec<u64>> = tokens
        .iter()
        .zip(replicas)
        .map(|(t, r)| {
            let mut c = vec![0; ranks];
            apportion_into(t.iter().sum(), r, &mut rems, &mut c);
            c
        })
        .collect();
    let mut load = vec![0u64; ranks];
    for c in &caps {
        load.iter_mut().zip(c).for_each(|(l, &x)| *l += x);
    }
    let holders: Vec<Vec<usize>> = replicas.iter().map(|r| (0..ranks).filter(|&j| r[j] > 0).collect()).collect();
    for _pass in 0..64 {
        let mut moved = false;
        for (e, hs) in holders.iter().enumerate() {
            if hs.len() < 2 {
                continue;
            }
            loop {
                // Most loaded holder that still has tokens of e, least loaded holder (lowest rank on ties).
                let hi = hs.iter().copied().filter(|&j| caps[e][j] > 0).max_by(|&a, &b| load[a].cmp(&load[b]).then(b.cmp(&a)));
                let lo = hs.iter().copied().min_by(|&a, &b| load[a].cmp(&load[b]).then(a.cmp(&b)));
                let (Some(hi), Some(lo)) = (hi, lo) else { break };
                let gap = load[hi].saturating_sub(load[lo]);
                if gap < 2 {
                    break;
                }
                let delta = (gap / 2).min(caps[e][hi]);
                caps[e][hi] -= delta;
                caps[e][lo] += delta;
                load[hi] -= delta;
                load[lo] += delta;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    caps
}

/// Largest-remainder apportionment of `total` over weights `w` (ties to the lower index).
pub fn apportion(total: u64, w: &[u32]) -> Vec<u64> {
    let mut out = vec![0; w.len()];
    apportion_into(total, w, &mut Vec::new(), &mut out);
    out
}

/// [`apportion`] into `out`, using `rems` as scratch; only ranks with a replica are touched.
fn apportion_into(total: u64, w: &[u32], rems: &mut Vec<(u64, usize)>, out: &mut [u64]) {
    out.iter_mut().for_each(|x| *x = 0);
    let sum: u64 = w.iter().map(|&x| x as u64).sum();
    if sum == 0 {
        return;
    }
    rems.clear();
    let mut given = 0u64;
    for (j, &x) in w.iter().enumerate() {
        if x == 0 {
            continue;
        }
        let prod = total as u128 * x as u128;
        let q = (prod / sum as u128) as u64;
        out[j] = q;
        given += q;
        let rem = (prod % sum as u128) as u64;
        if rem > 0 {
            rems.push((rem, j));
        }
    }
    let left = (total - given) as usize;
    if left > 0 {
        // Largest remainder first; equal remainders to the lower rank.
        rems.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, j) in rems.iter().take(left) {
            out[j] += 1;
        }
    }
}

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

#[cfg(test)]
pub(crate) static AUGMENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[derive(Default)]
struct Scratch {
    cap: Vec<u64>,
    local: Vec<u64>,
    rems: Vec<(u64, usize)>,
    senders: Vec<usize>,
    receivers: Vec<usize>,
    excess: Vec<u64>,
    residual: Vec<u64>,
    transport: Transport,
}

/// Routes of expert `e` given its capacities `sc.cap` (summing to its tokens).
fn expert_routes(e: u32, t: &[u64], sc: &mut Scratch, out: &mut Vec<Route>) {
    let total: u64 = t.iter().sum();
    if total == 0 {
        return;
    }
    sc.senders.clear();
    sc.receivers.clear();
    sc.excess.clear();
    sc.residual.clear();
    sc.local.clear();
    for j in 0..t.len() {
        let local = t[j].min(sc.cap[j]);
        sc.local.push(local);
        if t[j] > local {
            sc.senders.push(j);
            sc.excess.push(t[j] - local);
        } else if sc.cap[j] > local {
            sc.receivers.push(j);
            sc.residual.push(sc.cap[j] - local);
        }
    }
    let moved: u64 = sc.excess.iter().sum();
    if moved > 0 {
        sc.transport.round(&sc.excess, &sc.residual, moved);
    }
    // Emit in (src, dst) order: senders and receivers are disjoint, so a sender's row is its
    // local entry merged into its transfers, which are in ascending receiver order.
    let nb = sc.receivers.len();
    let mut next_sender = 0;
    for src in 0..t.len() {
        let row = (next_sender < sc.senders.len() && sc.senders[next_sender] == src).then(|| {
            next_sender += 1;
            next_sender - 1
        });
        let mut local_done = sc.local[src] == 0;
        let mut push = |dst: usize, tokens: u64| out.push(Route { expert: e, src: src as u32, dst: dst as u32, tokens });
        if let Some(a) = row {
            for (b, &dst) in sc.receivers.iter().enumerate() {
                if !local_done && dst > src {
                    push(src, sc.local[src]);
                    local_done = true;
                }
                let tokens = sc.transport.m[a * nb + b];
                if tokens > 0 {
                    push(dst, tokens);
                }
            }
        }
        if !local_done {
            push(src, sc.local[src]);
        }
    }
}

/// Rounds the matrix x_ab = X_a·P_b/S (S = ΣX = ΣP) to integers within 1 of x, keeping every
/// row sum X_a and column sum P_b. Buffers are reused across experts.
#[derive(Default)]
struct Transport {
    /// The result, row-major (senders × receivers).
    m: Vec<u64>,
    frac: Vec<u64>,
    bump: Vec<bool>,
    row_left: Vec<u64>,
    col_left: Vec<u64>,
    rows: Vec<usize>,
    cols: Vec<usize>,
}

impl Transport {
    fn round(&mut self, x: &[u64], p: &[u64], s: u64) {
        let (na, nb) = (x.len(), p.len());
        self.m.clear();
        self.m.resize(na * nb, 0);
        self.frac.clear();
        self.frac.resize(na * nb, 0);
        self.row_left.clear();
        self.row_left.extend_from_slice(x);
        self.col_left.clear();
        self.col_left.extend_from_slice(p);
        // Integer division is the hot spot; below 2^52 a float estimate off by at most one,
        // corrected with the exact remainder, gives the same quotient far faster.
        let inv = 1.0 / s as f64;
        let div = |prod: u64| -> (u64, u64) {
            if prod < (1 << 52) {
                let mut q = (prod as f64 * inv) as i64 as u64;
                let mut rem = prod as i64 - (q * s) as i64;
                if rem < 0 {
                    q -= 1;
                    rem += s as i64;
                } else if rem >= s as i64 {
                    q += 1;
                    rem -= s as i64;
                }
                (q, rem as u64)
            } else {
                (prod / s, prod % s)
            }
        };
        for a in 0..na {
            for b in 0..nb {
                let (q, rem) = match x[a].checked_mul(p[b]) {
                    Some(prod) => div(prod),
                    None => {
                        let prod = x[a] as u128 * p[b] as u128;
                        ((prod / s as u128) as u64, (prod % s as u128) as u64)
                    }
                };
                self.m[a * nb + b] = q;
                self.frac[a * nb + b] = rem;
                self.row_left[a] -= q;
                self.col_left[b] -= q;
            }
        }
        if self.row_left.iter().all(|&v| v == 0) {
            return;
        }
        self.bump.clear();
        self.bump.resize(na * nb, false);
        // Ryser's construction: rows with the most units first, each taking the columns that
        // still need the most units (then the larger fraction). With every cell available this
        // always succeeds (Gale–Ryser); cells whose ideal is already an integer are not
        // available, and the rare row left short is completed by an augmenting path.
        self.rows.clear();
        self.rows.extend((0..na).filter(|&a| self.row_left[a] > 0));
        self.rows.sort_unstable_by(|&u, &v| self.row_left[v].cmp(&self.row_left[u]).then(u.cmp(&v)));
        for i in 0..self.rows.len() {
            let a = self.rows[i];
            let frac = &self.frac[a * nb..(a + 1) * nb];
            let col_left = &self.col_left;
            self.cols.clear();
            self.cols.extend((0..nb).filter(|&b| frac[b] > 0 && col_left[b] > 0));
            let want = self.row_left[a] as usize;
            let by_need = |u: &usize, v: &usize| col_left[*v].cmp(&col_left[*u]).then(frac[*v].cmp(&frac[*u])).then(u.cmp(v));
            if want < self.cols.len() {
                self.cols.select_nth_unstable_by(want, by_need);
                self.cols.truncate(want);
            }
            for &b in &self.cols {
                self.bump[a * nb + b] = true;
                self.row_left[a] -= 1;
                self.col_left[b] -= 1;
            }
        }
        for a0 in 0..na {
            while self.row_left[a0] > 0 {
                self.augment(a0, na, nb);
            }
        }
        for (v, &up) in self.m.iter_mut().zip(&self.bump) {
            *v += up as u64;
        }
    }

    /// One augmenting path for row `a0` the greedy left short: row → (unbumped fractional
    /// cell) → column → (bumped cell) → row … until a column with units left is reached.
    fn augment(&mut self, a0: usize, na: usize, nb: usize) {
        #[cfg(test)]
        AUGMENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut prev_col: Vec<Option<usize>> = vec![None; nb];
        let mut prev_row: Vec<Option<usize>> = vec![None; na];
        let mut seen_row = vec![false; na];
        seen_row[a0] = true;
        let mut queue = std::collections::VecDeque::from([a0]);
        let mut end = None;
        'bfs: while let Some(a) = queue.pop_front() {
            for b in 0..nb {
                if self.frac[a * nb + b] == 0 || self.bump[a * nb + b] || prev_col[b].is_some() {
                    continue;
                }
                prev_col[b] = Some(a);
                if self.col_left[b] > 0 {
                    end = Some(b);
                    break 'bfs;
                }
                for a2 in 0..na {
                    if self.bump[a2 * nb + b] && !seen_row[a2] {
                        seen_row[a2] = true;
                        prev_row[a2] = Some(b);
                        queue.push_back(a2);
                    }
                }
            }
        }
        // The fractional matrix is a feasible flow, so an integral rounding always exists and
        // an augmenting path is always found.
        let Some(mut b) = end else { unreachable!("transport rounding: no augmenting path") };
        self.col_left[b] -= 1;
        loop {
            let Some(a) = prev_col[b] else { unreachable!("broken augmenting path") };
            self.bump[a * nb + b] = true;
            match prev_row[a] {
                Some(b_prev) => {
                    self.bump[a * nb + b_prev] = false;
                    b = b_prev;
                }
                None => {
                    self.row_left[a] -= 1;
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check_invariants(t: &[Vec<u64>], r: &[Vec<u32>], d: &DispatchSchedule) -> Result<(), TestCaseError> {
        let dense = d.dense();
        let ranks = t[0].len();
        for e in 0..t.len() {
            let te: u64 = t[e].iter().sum();
            let re: u64 = r[e].iter().map(|&x| x as u64).sum();
            let cap = apportion(te, &r[e]);
            for src in 0..ranks {
                // Conservation: every token routed on src is sent somewhere exactly once.
                prop_assert_eq!(dense[e][src].iter().sum::<u64>(), t[e][src]);
                // Local capacity first.
                prop_assert_eq!(dense[e][src][src], t[e][src].min(cap[src]));
            }
            for dst in 0..ranks {
                let got: u64 = (0..ranks).map(|s| dense[e][s][dst]).sum();
                // Each rank processes exactly its capacity, within one token of R·t/r.
                prop_assert_eq!(got, cap[dst]);
                let ideal = te as f64 * r[e][dst] as f64 / re.max(1) as f64;
                prop_assert!((got as f64 - ideal).abs() < 1.0);
                if r[e][dst] == 0 {
                    prop_assert_eq!(got, 0);
                }
            }
            // Off-diagonal entries within one token of the proportional ideal of line 10.
            let excess: Vec<u64> = (0..ranks).map(|j| t[e][j] - dense[e][j][j]).collect();
            let resid: Vec<u64> = (0..ranks).map(|j| cap[j] - dense[e][j][j]).collect();
            let total: u64 = excess.iter().sum();
            for src in 0..ranks {
                for dst in 0..ranks {
                    if src == dst || total == 0 {
                        continue;
                    }
                    let ideal = excess[src] as f64 * resid[dst] as f64 / total as f64;
                    prop_assert!(
                        (dense[e][src][dst] as f64 - ideal).abs() < 1.0,
                        "e={} {}->{}: {} vs ideal {}",
                        e,
                        src,
                        dst,
                        dense[e][src][dst],
                        ideal
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn two_replicas_on_one_rank_get_two_shares() {
        // Expert 0: 3 replicas, two on rank 1. 90 tokens all routed on rank 0.
        let t = vec![vec![90, 0, 0]];
        let r = vec![vec![1, 2, 0]];
        let d = DispatchSchedule::compute(&t, &r).unwrap();
        assert_eq!(d.get(0, 0, 0), 30);
        assert_eq!(d.get(0, 0, 1), 60);
        assert_eq!(d.processed_per_rank(), vec![30, 60, 0]);
        assert_eq!(d.send_counts(0), vec![30, 60, 0]);
        assert_eq!(d.recv_counts(1), vec![60, 0, 0]);
    }

    /// Simulate every rank: lay out, "send", let each receiver tag rows with (expert, rank),
    /// send back, and check every slot got its own expert processed on a rank holding it.
    #[test]
    fn rank_layouts_round_trip_every_slot() {
        let mut rng = crate::rng::SplitMix64::new(5);
        for _ in 0..200 {
            let ranks = 1 + rng.below(5);
            let experts = 1 + rng.below(6);
            let r: Vec<Vec<u32>> = (0..experts)
                .map(|_| {
                    let mut v: Vec<u32> = (0..ranks).map(|_| rng.below(3) as u32).collect();
                    let k = rng.below(ranks);
                    v[k] = v[k].max(1);
                    v
                })
                .collect();
            let choices: Vec<Vec<u32>> = (0..ranks).map(|_| (0..rng.below(40)).map(|_| rng.below(experts) as u32).collect()).collect();
            let mut t = vec![vec![0u64; ranks]; experts];
            for (rank, c) in choices.iter().enumerate() {
                c.iter().for_each(|&e| t[e as usize][rank] += 1);
            }
            let d = DispatchSchedule::compute(&t, &r).unwrap();
            let layouts: Vec<RankLayout> = (0..ranks).map(|me| RankLayout::new(&d, me, &choices[me]).unwrap()).collect();
            // What each receiver gets from each sender: (expert of each row).
            let mut result: Vec<Vec<Option<(u32, usize)>>> = choices.iter().map(|c| vec![None; c.len()]).collect();
            for dst in 0..ranks {
                for src in 0..ranks {
                    let rows = &layouts[src].send_experts[dst];
                    // The receiver's view of the layout matches what the sender packed.
                    let expected: Vec<u32> =
                        (0..experts).flat_map(|e| std::iter::repeat_n(e as u32, layouts[dst].recv[src][e] as usize)).collect();
                    assert_eq!(rows, &expected);
                    for (i, &e) in rows.iter().enumerate() {
                        assert!(r[e as usize][dst] > 0, "expert {e} sent to rank {dst} without a replica");
                        let slot = layouts[src].send[dst][i] as usize;
                        assert!(result[src][slot].is_none(), "slot sent twice");
                        result[src][slot] = Some((e, dst));
                    }
                }
            }
            for (rank, c) in choices.iter().enumerate() {
                for (slot, &e) in c.iter().enumerate() {
                    assert_eq!(result[rank][slot].map(|x| x.0), Some(e), "rank {rank} slot {slot}");
                }
            }
        }
    }

    #[test]
    fn rank_layout_rejects_choices_that_disagree_with_the_schedule() {
        let d = DispatchSchedule::compute(&[vec![2, 0]], &[vec![1, 1]]).unwrap();
        assert!(RankLayout::new(&d, 0, &[0]).is_err());
        assert!(RankLayout::new(&d, 0, &[0, 0, 0]).is_err());
        assert!(RankLayout::new(&d, 0, &[0, 5]).is_err());
        assert!(RankLayout::new(&d, 2, &[0, 0]).is_err());
        let ok = RankLayout::new(&d, 0, &[0, 0]).unwrap();
        assert_eq!(ok.send, vec![vec![0], vec![1]]);
    }

    #[test]
    fn tokens_without_a_replica_are_an_error() {
        let err = DispatchSchedule::compute(&[vec![1, 0]], &[vec![0, 0]]).unwrap_err().to_string();
        assert!(err.contains("expert 0"), "{err}");
        assert!(DispatchSchedule::compute(&[vec![1, 0]], &[vec![1]]).is_err());
        assert!(DispatchSchedule::compute(&[vec![1, 0]], &[]).is_err());
    }

    #[test]
    fn apportion_is_exact_and_within_one() {
        assert_eq!(apportion(10, &[1, 1, 1]), vec![4, 3, 3]);
        assert_eq!(apportion(0, &[1, 2]), vec![0, 0]);
        assert_eq!(apportion(7, &[0, 3, 0, 4]), vec![0, 3, 0, 4]);
    }

    /// Small counts leave cells whose ideal is an integer, where Ryser's greedy can get stuck;
    /// make sure the augmenting-path repair runs and still yields a valid schedule.
    #[test]
    fn augmenting_repair_is_exercised() {
        let before = AUGMENTS.load(std::sync::atomic::Ordering::Relaxed);
        let mut rng = crate::rng::SplitMix64::new(7);
        for _ in 0..20_000 {
            let ranks = 3 + rng.below(5);
            let t = vec![(0..ranks).map(|_| rng.below(7) as u64).collect::<Vec<_>>()];
            let r = vec![(0..ranks).map(|_| rng.below(3) as u32).collect::<Vec<_>>()];
            if r[0].iter().all(|&x| x == 0) {
                continue;
            }
            let d = DispatchSchedule::compute(&t, &r).unwrap();
            check_invariants(&t, &r, &d).unwrap();
        }
        assert!(AUGMENTS.load(std::sync::atomic::Ordering::Relaxed) > before, "repair path never taken");
    }

    proptest! {
        #[test]
        fn schedule_invariants(
            ranks in 1usize..9,
            experts in 1usize..7,
            seed in any::<u64>(),
        ) {
            let mut rng = crate::rng::SplitMix64::new(seed);
            let t: Vec<Vec<u64>> = (0..experts)
                .map(|_| (0..ranks).map(|_| if rng.below(4) == 0 { 0 } else { rng.below(500) as u64 }).collect())
                .collect();
            let r: Vec<Vec<u32>> = (0..experts)
                .map(|_| {
                    let mut v: Vec<u32> = (0..ranks).map(|_| if rng.below(2) == 0 { 0 } else { rng.below(3) as u32 }).collect();
                    let k = rng.below(ranks);
                    v[k] = v[k].max(1);
                    v
                })
                .collect();
            let d = DispatchSchedule::compute(&t, &r).unwrap();
            check_invariants(&t, &r, &d)?;
            // A pure function: any rank recomputing it gets the same matrix.
            prop_assert_eq!(DispatchSchedule::compute(&t, &r).unwrap(), d.clone());

            // The rank-balanced variant: tokens conserved, only holders process, local first
            // under its own capacities, and no rank busier than under per-replica shares.
            let b = DispatchSchedule::compute_balanced(&t, &r).unwrap();
            prop_assert_eq!(DispatchSchedule::compute_balanced(&t, &r).unwrap(), b.clone());
            let caps = balanced_capacities(&t, &r);
            let dense = b.dense();
            for e in 0..experts {
                prop_assert_eq!(caps[e].iter().sum::<u64>(), t[e].iter().sum::<u64>());
                for src in 0..ranks {
                    prop_assert_eq!(dense[e][src].iter().sum::<u64>(), t[e][src]);
                    prop_assert_eq!(dense[e][src][src], t[e][src].min(caps[e][src]));
                }
                for dst in 0..ranks {
                    let got: u64 = (0..ranks).map(|s| dense[e][s][dst]).sum();
                    prop_assert_eq!(got, caps[e][dst]);
                    if r[e][dst] == 0 {
                        prop_assert_eq!(got, 0);
                    }
                }
            }
            let max = |v: Vec<u64>| v.into_iter().max().unwrap_or(0);
            prop_assert!(max(b.processed_per_rank()) <= max(d.processed_per_rank()));
        }
    }

    #[test]
    fn balancing_evens_out_a_hot_expert_spread_three_two_two_two() {
        // 9 replicas of expert 0 over 4 ranks (3, 2, 2, 2), 900 tokens from each rank.
        let t = vec![vec![900u64; 4]];
        let r = vec![vec![3u32, 2, 2, 2]];
        let per_replica = DispatchSchedule::compute(&t, &r).unwrap().processed_per_rank();
        assert_eq!(per_replica, vec![1200, 800, 800, 800]);
        let balanced = DispatchSchedule::compute_balanced(&t, &r).unwrap().processed_per_rank();
        assert_eq!(balanced, vec![900, 900, 900, 900]);
        // Holder sets limit it: expert 1 lives only on rank 0, so rank 0 gives away all of 0.
        let t = vec![vec![100u64, 100], vec![300, 0]];
        let r = vec![vec![1u32, 1], vec![1, 0]];
        let caps = balanced_capacities(&t, &r);
        assert_eq!(caps, vec![vec![0, 200], vec![300, 0]]);
    }
}
