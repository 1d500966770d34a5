//! How many of an expert's tokens each rank processes: per-replica shares (Algorithm 1) or
//! shares that even out the ranks' totals (the rank-balanced dispatcher).

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
pub(crate) fn apportion_into(total: u64, w: &[u32], rems: &mut Vec<(u64, usize)>, out: &mut [u64]) {
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
