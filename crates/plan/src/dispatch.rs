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
    /// Compute D from the all-gathered token counts and the replica counts R[e][rank].
    pub fn compute(tokens: &[Vec<u64>], replicas: &[Vec<u32>]) -> Result<Self, PlanError> {
        let experts = tokens.len();
        if replicas.len() != experts {
            return Err(PlanError::Length {
                field: "replicas",
                got: replicas.len(),
                expected: experts,
            });
        }
        let ranks = tokens.first().map_or(0, Vec::len);
        for (e, (t, r)) in tokens.iter().zip(replicas).enumerate() {
            if t.len() != ranks {
                return Err(PlanError::Length {
                    field: "tokens",
                    got: t.len(),
                    expected: ranks,
                });
            }
            if r.len() != ranks {
                return Err(PlanError::Length {
                    field: "replicas",
                    got: r.len(),
                    expected: ranks,
                });
            }
            if r.iter().all(|&x| x == 0) && t.iter().any(|&x| x > 0) {
                return Err(PlanError::invalid(
                    "replicas",
                    format!("expert {e}"),
                    "tokens are routed to an expert that has no replica",
                ));
            }
        }
        let mut routes = Vec::new();
        let mut start = Vec::with_capacity(experts + 1);
        let mut scratch = Scratch::default();
        for e in 0..experts {
            start.push(routes.len());
            expert_routes(e as u32, &tokens[e], &replicas[e], &mut scratch, &mut routes);
        }
        start.push(routes.len());
        Ok(DispatchSchedule {
            experts,
            ranks,
            routes,
            start,
        })
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
        self.routes(expert)
            .iter()
            .find(|r| r.src as usize == src && r.dst as usize == dst)
            .map_or(0, |r| r.tokens)
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

/// Largest-remainder apportionment of `total` over weights `w` (ties to the lower index).
pub fn apportion(total: u64, w: &[u32]) -> Vec<u64> {
    let sum: u64 = w.iter().map(|&x| x as u64).sum();
    if sum == 0 {
        return vec![0; w.len()];
    }
    let mut out: Vec<u64> = w.iter().map(|&x| ((total as u128 * x as u128) / sum as u128) as u64).collect();
    let mut left = total - out.iter().sum::<u64>();
    if left > 0 {
        let mut idx: Vec<usize> = (0..w.len()).collect();
        let rem = |j: usize| (total as u128 * w[j] as u128) % sum as u128;
        idx.sort_by(|&a, &b| rem(b).cmp(&rem(a)).then(a.cmp(&b)));
        for j in idx {
            if left == 0 {
                break;
            }
            if rem(j) > 0 {
                out[j] += 1;
                left -= 1;
            }
        }
    }
    out
}

#[derive(Default)]
struct Scratch {
    senders: Vec<usize>,
    receivers: Vec<usize>,
    excess: Vec<u64>,
    residual: Vec<u64>,
}

fn expert_routes(e: u32, t: &[u64], r: &[u32], sc: &mut Scratch, out: &mut Vec<Route>) {
    let total: u64 = t.iter().sum();
    if total == 0 {
        return;
    }
    let cap = apportion(total, r);
    sc.senders.clear();
    sc.receivers.clear();
    sc.excess.clear();
    sc.residual.clear();
    let first = out.len();
    for j in 0..t.len() {
        let local = t[j].min(cap[j]);
        if local > 0 {
            out.push(Route {
                expert: e,
                src: j as u32,
                dst: j as u32,
                tokens: local,
            });
        }
        if t[j] > local {
            sc.senders.push(j);
            sc.excess.push(t[j] - local);
        } else if cap[j] > local {
            sc.receivers.push(j);
            sc.residual.push(cap[j] - local);
        }
    }
    let moved: u64 = sc.excess.iter().sum();
    if moved > 0 {
        let m = round_transport(&sc.excess, &sc.residual, moved);
        for (a, &src) in sc.senders.iter().enumerate() {
            for (b, &dst) in sc.receivers.iter().enumerate() {
                let tokens = m[a * sc.receivers.len() + b];
                if tokens > 0 {
                    out.push(Route {
                        expert: e,
                        src: src as u32,
                        dst: dst as u32,
                        tokens,
                    });
                }
            }
        }
    }
    out[first..].sort_unstable_by_key(|r| (r.src, r.dst));
}

/// Round the matrix x_ab = X_a·P_b/S (S = ΣX = ΣP) to integers within 1 of x, keeping every row
/// sum X_a and column sum P_b. Returns the matrix row-major.
fn round_transport(x: &[u64], p: &[u64], s: u64) -> Vec<u64> {
    let (na, nb) = (x.len(), p.len());
    let mut m = vec![0u64; na * nb];
    let mut frac = vec![0u64; na * nb];
    let mut row_left = x.to_vec();
    let mut col_left = p.to_vec();
    for a in 0..na {
        for b in 0..nb {
            let prod = x[a] as u128 * p[b] as u128;
            let q = (prod / s as u128) as u64;
            m[a * nb + b] = q;
            frac[a * nb + b] = (prod % s as u128) as u64;
            row_left[a] -= q;
            col_left[b] -= q;
        }
    }
    if row_left.iter().all(|&v| v == 0) {
        return m;
    }
    // Greedy: each row takes its units on the cells with the largest fractional parts whose
    // column still needs units.
    let mut bump = vec![false; na * nb];
    let mut cols: Vec<usize> = Vec::with_capacity(nb);
    for a in 0..na {
        cols.clear();
        cols.extend((0..nb).filter(|&b| frac[a * nb + b] > 0));
        cols.sort_by(|&u, &v| frac[a * nb + v].cmp(&frac[a * nb + u]).then(u.cmp(&v)));
        for &b in &cols {
            if row_left[a] == 0 {
                break;
            }
            if col_left[b] > 0 {
                bump[a * nb + b] = true;
                row_left[a] -= 1;
                col_left[b] -= 1;
            }
        }
    }
    // Augmenting paths for rows the greedy left short: row → (unbumped fractional cell) → column
    // → (bumped cell) → row … until a column with units left is reached.
    for a0 in 0..na {
        while row_left[a0] > 0 {
            let mut prev_col: Vec<Option<usize>> = vec![None; nb]; // column -> row that reached it
            let mut prev_row: Vec<Option<usize>> = vec![None; na]; // row -> column it came from
            let mut seen_row = vec![false; na];
            seen_row[a0] = true;
            let mut queue = std::collections::VecDeque::from([a0]);
            let mut end = None;
            'bfs: while let Some(a) = queue.pop_front() {
                for b in 0..nb {
                    if frac[a * nb + b] == 0 || bump[a * nb + b] || prev_col[b].is_some() {
                        continue;
                    }
                    prev_col[b] = Some(a);
                    if col_left[b] > 0 {
                        end = Some(b);
                        break 'bfs;
                    }
                    for a2 in 0..na {
                        if bump[a2 * nb + b] && !seen_row[a2] {
                            seen_row[a2] = true;
                            prev_row[a2] = Some(b);
                            queue.push_back(a2);
                        }
                    }
                }
            }
            let Some(mut b) = end else {
                unreachable!("a fractional transport plan always has an integral rounding")
            };
            col_left[b] -= 1;
            loop {
                let a = prev_col[b].expect("path");
                bump[a * nb + b] = true;
                match prev_row[a] {
                    Some(b_prev) => {
                        bump[a * nb + b_prev] = false;
                        b = b_prev;
                    }
                    None => {
                        row_left[a] -= 1;
                        break;
                    }
                }
            }
        }
    }
    for (v, &up) in m.iter_mut().zip(&bump) {
        *v += up as u64;
    }
    m
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
                    prop_assert!((dense[e][src][dst] as f64 - ideal).abs() < 1.0,
                        "e={} {}->{}: {} vs ideal {}", e, src, dst, dense[e][src][dst], ideal);
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
            prop_assert_eq!(DispatchSchedule::compute(&t, &r).unwrap(), d);
        }
    }
}
