//! Exact integer rounding of one expert's excess tokens over the residual capacities: every
//! row (sender) and column (receiver) sum kept, every entry within one token of its ideal.

use super::Route;

#[cfg(test)]
pub(crate) static AUGMENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) cap: Vec<u64>,
    local: Vec<u64>,
    pub(crate) rems: Vec<(u64, usize)>,
    senders: Vec<usize>,
    receivers: Vec<usize>,
    excess: Vec<u64>,
    residual: Vec<u64>,
    transport: TransportRounding,
}

/// Routes of expert `e` given its capacities `sc.cap` (summing to its tokens).
pub(crate) fn expert_routes(e: u32, t: &[u64], sc: &mut Scratch, out: &mut Vec<Route>) {
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
pub(crate) struct TransportRounding {
    /// The result, row-major (senders × receivers).
    m: Vec<u64>,
    frac: Vec<u64>,
    bump: Vec<bool>,
    row_left: Vec<u64>,
    col_left: Vec<u64>,
    rows: Vec<usize>,
    cols: Vec<usize>,
}

impl TransportRounding {
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
