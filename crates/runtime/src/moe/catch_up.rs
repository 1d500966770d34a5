//! Catching a restored expert up on the tokens it lost (MoEtion §6): an expert restored from a
//! snapshot older than the job missed the updates of the tokens it processed since. MoEtion
//! raises such an expert's capacity by ~10% until those tokens are made up. Our dispatcher drops
//! no token, so "capacity" here is the router's choice itself: on each rank, the tokens that
//! rank the expert highest among those that did not pick it (about a tenth of its own tokens)
//! swap their weakest choice for it.

/// How much more work a catching-up expert gets: MoEtion's 10%.
pub const CATCH_UP_FRACTION: f64 = 0.1;

/// Raise each expert of `boosted` in `choices` (token-major, `k` per token, from `probs`) by
/// `fraction` of its tokens on this rank (at least `fraction` of a fair share, so an expert the
/// router has stopped choosing is chosen again): the tokens not choosing it with the highest
/// probability for it replace their lowest-probability choice by it. Returns the tokens moved.
/// A choice of another boosted expert is never replaced; a token takes at most one boost.
pub fn boost_choices(probs: &[Vec<f64>], choices: &mut [u32], k: usize, boosted: &[usize], fraction: f64) -> usize {
    let n = probs.len();
    if boosted.is_empty() || k == 0 || choices.len() != n * k || n == 0 {
        return 0;
    }
    let experts = probs[0].len();
    let mut taken = vec![false; n];
    let mut moved = 0;
    for &e in boosted {
        if e >= experts {
            continue;
        }
        let have = choices.iter().filter(|&&c| c as usize == e).count();
        let fair = (n * k) as f64 / experts as f64;
        let want = (fraction * (have as f64).max(fair)).ceil() as usize;
        let mut candidates: Vec<usize> = (0..n).filter(|&t| !taken[t] && !choices[t * k..(t + 1) * k].contains(&(e as u32))).collect();
        candidates.sort_by(|&a, &b| probs[b][e].total_cmp(&probs[a][e]).then(a.cmp(&b)));
        for t in candidates.into_iter().take(want) {
            let row = &mut choices[t * k..(t + 1) * k];
            let weakest = (0..k)
                .filter(|&j| !boosted.contains(&(row[j] as usize)))
                .min_by(|&a, &b| probs[t][row[a] as usize].total_cmp(&probs[t][row[b] as usize]));
            if let Some(j) = weakest {
                row[j] = e as u32;
                taken[t] = true;
                moved += 1;
            }
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boosted_expert_gets_about_a_tenth_more_tokens_from_those_that_rank_it_highest() {
        // 20 tokens, 4 experts, top-1: expert 0 chosen by 10, expert 3 by none.
        let probs: Vec<Vec<f64>> = (0..20)
            .map(|t| if t < 10 { vec![0.7, 0.1, 0.1, 0.1] } else { vec![0.1, 0.6, 0.3 - 0.01 * t as f64, 0.01 * t as f64] })
            .collect();
        let mut choices: Vec<u32> = (0..20).map(|t| if t < 10 { 0 } else { 1 }).collect();
        let before = choices.clone();
        // Expert 0 has 10 tokens: one more, from the token ranking it highest (all tie: the first).
        assert_eq!(boost_choices(&probs, &mut choices, 1, &[0], 0.1), 1);
        assert_eq!(choices.iter().filter(|&&c| c == 0).count(), 11);
        assert_eq!(choices[10], 0);
        // Expert 3, chosen by nobody: a tenth of a fair share (5), rounded up: the token that
        // ranks it highest (t = 19).
        let mut c = before.clone();
        assert_eq!(boost_choices(&probs, &mut c, 1, &[3], 0.1), 1);
        assert_eq!((c[19], c.iter().filter(|&&x| x == 3).count()), (3, 1));
        // Top-2: the weaker of a token's two choices goes.
        let probs = vec![vec![0.5, 0.3, 0.2]; 10];
        let mut c: Vec<u32> = (0..10).flat_map(|_| [0u32, 1]).collect();
        assert_eq!(boost_choices(&probs, &mut c, 2, &[2], 0.1), 1);
        assert_eq!(&c[..4], &[0, 2, 0, 1]);
        // Never another boosted expert: with 1 boosted too, token 0 gives up expert 0 instead.
        let mut c: Vec<u32> = (0..10).flat_map(|_| [0u32, 1]).collect();
        assert_eq!(boost_choices(&probs, &mut c, 2, &[2, 1], 0.1), 1);
        assert_eq!(&c[..4], &[2, 1, 0, 1]);
        // Nothing boosted, nothing changes; bad shapes change nothing.
        let mut c2 = before.clone();
        assert_eq!(boost_choices(&vec![vec![0.5, 0.5]; 20], &mut c2, 1, &[], 0.1), 0);
        assert_eq!(boost_choices(&vec![vec![0.5, 0.5]; 3], &mut c2, 1, &[0], 0.1), 0);
        assert_eq!(c2, before);
    }
}
