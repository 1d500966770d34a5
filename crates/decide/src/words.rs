//! Lists of ids (workers, experts, ranks) as people read them in messages and the status:
//! `0, 2, 4–9`, not `[0, 2, 4, 5, 6, 7, 8, 9]` or `4..10`.

/// `ids` in order, without repeats, each run of three or more consecutive ids as `first–last`.
pub fn id_list(ids: impl IntoIterator<Item = u64>) -> String {
    let mut sorted: Vec<u64> = ids.into_iter().collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        match j - i {
            0 => parts.push(sorted[i].to_string()),
            1 => parts.extend([sorted[i].to_string(), sorted[j].to_string()]),
            _ => parts.push(format!("{}–{}", sorted[i], sorted[j])),
        }
        i = j + 1;
    }
    if parts.is_empty() {
        return "none".into();
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_three_or_more_read_as_ranges() {
        assert_eq!(id_list([4u64, 5]), "4, 5");
        assert_eq!(id_list(4u64..10), "4–9");
        assert_eq!(id_list([9u64, 0, 2, 4, 5, 6, 7, 8, 2]), "0, 2, 4–9");
        assert_eq!(id_list([3]), "3");
        assert_eq!(id_list(Vec::<u64>::new()), "none");
    }

    proptest::proptest! {
        /// Read back, the list is the set of ids given.
        #[test]
        fn the_list_reads_back_as_the_ids(ids in proptest::collection::btree_set(0u64..60, 0..30)) {
            let text = id_list(ids.iter().copied());
            let mut back = std::collections::BTreeSet::new();
            if text != "none" {
                for part in text.split(", ") {
                    match part.split_once('–') {
                        Some((a, b)) => back.extend(a.parse::<u64>().unwrap()..=b.parse::<u64>().unwrap()),
                        None => { back.insert(part.parse::<u64>().unwrap()); }
                    }
                }
            }
            proptest::prop_assert_eq!(back, ids);
        }
    }
}
