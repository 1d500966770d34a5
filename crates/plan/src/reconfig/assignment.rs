//! Which live node takes which node of a new plan: the assignment that moves the fewest bytes.
//!
//! [`min_cost_assignment`] is the Hungarian algorithm with potentials (rows added one at a
//! time, each by a shortest augmenting path over the columns). Its answer among equal-cost
//! assignments follows from the order of its comparisons, and a move's transfers, a weighing's
//! verdict and so a simulated day's samples follow from that answer: a faster form must give
//! the same one. This one defers the potentials' updates of the columns already reached (each
//! step of a row's search added the step's minimum to all of them) to the end of the row,
//! keeping the unreached columns' minima in a frame shifted by the total so far: the same
//! comparisons, one pass over the columns a step instead of two. The plain form is kept beside
//! it as its oracle.

/// Far above any cost (bytes of a move), far below overflow when shifted by a row's steps.
const INF: i64 = i64::MAX / 4;

/// Exact minimum-cost perfect matching of rows to columns. Returns `col[row]`.
pub(crate) fn min_cost_assignment(cost: &[Vec<i64>]) -> Vec<usize> {
    let n = cost.len();
    let mut u = vec![0i64; n + 1];
    let mut v = vec![0i64; n + 1];
    let mut p = vec![0usize; n + 1]; // p[col] = row (1-based), 0 = free
    let mut way = vec![0usize; n + 1];
    // The unreached columns' minima plus `shift` (the steps' total so far in this row).
    let mut shifted = vec![INF; n + 1];
    let mut used = vec![false; n + 1];
    // The columns reached in this row, with the total when each was reached.
    let mut reached: Vec<(usize, i64)> = Vec::with_capacity(n + 1);
    for i in 1..=n {
        p[0] = i;
        let mut j0 = 0;
        let mut shift = 0i64;
        shifted.fill(INF);
        used.fill(false);
        reached.clear();
        loop {
            used[j0] = true;
            reached.push((j0, shift));
            // Row i0 = p[j0] has had no update in this row yet (its column was just reached).
            let i0 = p[j0];
            let (row, ui0) = (&cost[i0 - 1], u[i0]);
            let mut best = INF;
            let mut j1 = 0;
            let columns = row.iter().zip(&v[1..]).zip(&used[1..]).zip(shifted[1..].iter_mut()).zip(way[1..].iter_mut());
            for (k, ((((&c, &vj), &uj), m), w)) in columns.enumerate() {
                if !uj {
                    // `c - ui0 - vj < minv` in the shifted frame.
                    let cur = c - ui0 - vj + shift;
                    if cur < *m {
                        *m = cur;
                        *w = j0;
                    }
                    if *m < best {
                        best = *m;
                        j1 = k + 1;
                    }
                }
            }
            // The step's minimum (`delta`), added to every reached column's potential below.
            shift = best;
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        for &(j, at) in &reached {
            u[p[j]] += shift - at;
            v[j] -= shift - at;
        }
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut col = vec![0usize; n];
    for j in 1..=n {
        col[p[j] - 1] = j - 1;
    }
    col
}

/// The paper's greedy: repeatedly take the cheapest (node, plan node) pair still free.
pub(crate) fn greedy_assignment(cost: &[Vec<i64>]) -> Vec<usize> {
    let n = cost.len();
    let mut col = vec![usize::MAX; n];
    let mut taken = vec![false; n];
    for (row, c) in col.iter_mut().enumerate() {
        let best = (0..n).filter(|&q| !taken[q]).min_by_key(|&q| (cost[row][q], q)).expect("free column");
        taken[best] = true;
        *c = best;
    }
    col
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    /// The plain Hungarian algorithm: every potential and minimum updated at every step.
    fn plain_assignment(cost: &[Vec<i64>]) -> Vec<usize> {
        let n = cost.len();
        let mut u = vec![0i64; n + 1];
        let mut v = vec![0i64; n + 1];
        let mut p = vec![0usize; n + 1];
        let mut way = vec![0usize; n + 1];
        let mut minv = vec![INF; n + 1];
        let mut used = vec![false; n + 1];
        for i in 1..=n {
            p[0] = i;
            let mut j0 = 0;
            minv.fill(INF);
            used.fill(false);
            loop {
                used[j0] = true;
                let i0 = p[j0];
                let mut delta = INF;
                let mut j1 = 0;
                for j in 1..=n {
                    if !used[j] {
                        let cur = cost[i0 - 1][j - 1] - u[i0] - v[j];
                        if cur < minv[j] {
                            minv[j] = cur;
                            way[j] = j0;
                        }
                        if minv[j] < delta {
                            delta = minv[j];
                            j1 = j;
                        }
                    }
                }
                for j in 0..=n {
                    if used[j] {
                        u[p[j]] += delta;
                        v[j] -= delta;
                    } else {
                        minv[j] -= delta;
                    }
                }
                j0 = j1;
                if p[j0] == 0 {
                    break;
                }
            }
            loop {
                let j1 = way[j0];
                p[j0] = p[j1];
                j0 = j1;
                if j0 == 0 {
                    break;
                }
            }
        }
        let mut col = vec![0usize; n];
        for j in 1..=n {
            col[p[j] - 1] = j - 1;
        }
        col
    }

    fn brute_min(cost: &[Vec<i64>]) -> i64 {
        fn rec(cost: &[Vec<i64>], row: usize, used: &mut Vec<bool>) -> i64 {
            if row == cost.len() {
                return 0;
            }
            let mut best = i64::MAX;
            for q in 0..cost.len() {
                if !used[q] {
                    used[q] = true;
                    best = best.min(cost[row][q] + rec(cost, row + 1, used));
                    used[q] = false;
                }
            }
            best
        }
        rec(cost, 0, &mut vec![false; cost.len()])
    }

    fn assignment_cost(cost: &[Vec<i64>], col: &[usize]) -> i64 {
        col.iter().enumerate().map(|(r, &c)| cost[r][c]).sum()
    }

    proptest! {
        #[test]
        fn assignment_is_one_to_one_and_optimal(n in 1usize..7, seed in any::<u64>()) {
            let mut rng = SplitMix64::new(seed);
            let cost: Vec<Vec<i64>> = (0..n).map(|_| (0..n).map(|_| rng.below(20) as i64).collect()).collect();
            let col = min_cost_assignment(&cost);
            let mut seen = col.clone();
            seen.sort();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
            prop_assert_eq!(assignment_cost(&cost, &col), brute_min(&cost));
            prop_assert!(assignment_cost(&cost, &greedy_assignment(&cost)) >= brute_min(&cost));
        }

        /// The same answer as the plain form, ties and all: costs from a few values (many
        /// equal-cost assignments), from a wide range, and rows that repeat (nodes alike).
        #[test]
        fn the_deferred_updates_give_the_plain_algorithms_answer(n in 1usize..48, values in 1u64..6, wide in any::<bool>(), seed in any::<u64>()) {
            let mut rng = SplitMix64::new(seed);
            let range = if wide { 1 << 40 } else { values as usize };
            let mut cost: Vec<Vec<i64>> = (0..n).map(|_| (0..n).map(|_| rng.below(range) as i64).collect()).collect();
            for r in 1..n {
                if rng.below(3) == 0 {
                    cost[r] = cost[rng.below(r)].clone();
                }
            }
            prop_assert_eq!(min_cost_assignment(&cost), plain_assignment(&cost));
        }
    }
}
