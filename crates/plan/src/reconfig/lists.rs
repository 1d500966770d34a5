//! Many short lists in two allocations.

/// Lists `0..len()`, list i being `items[start[i]..start[i + 1]]`.
///
/// Why: a move's planning at a thousand nodes lists, per layer, each expert's holders and each
/// plan node's wanted experts — tens of thousands of lists of a few entries. As separate vectors
/// their allocations took as long as the planning itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lists {
    start: Vec<usize>,
    items: Vec<usize>,
}

impl Default for Lists {
    /// No list yet.
    fn default() -> Self {
        Lists { start: vec![0], items: Vec::new() }
    }
}

impl Lists {
    /// Each list of `lists`, in order.
    #[cfg(test)]
    pub(crate) fn of<'a>(lists: impl IntoIterator<Item = &'a [usize]>) -> Self {
        let mut out = Lists::default();
        for l in lists {
            out.push(l);
        }
        out
    }

    /// Lists `0..count` of `(list, item)` pairs, each list's items in the pairs' order (a
    /// counting sort on the list).
    pub(crate) fn grouped(count: usize, pairs: &[(usize, usize)]) -> Self {
        let mut start = vec![0usize; count + 1];
        for &(i, _) in pairs {
            start[i + 1] += 1;
        }
        for i in 0..count {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut items = vec![0; pairs.len()];
        for &(i, x) in pairs {
            items[fill[i]] = x;
            fill[i] += 1;
        }
        Lists { start, items }
    }

    /// `list` as the next list.
    #[cfg(test)]
    pub(crate) fn push(&mut self, list: &[usize]) {
        self.items.extend_from_slice(list);
        self.start.push(self.items.len());
    }

    /// The next list, made by `fill` appending its items.
    pub(crate) fn push_with(&mut self, fill: impl FnOnce(&mut Vec<usize>)) {
        fill(&mut self.items);
        self.start.push(self.items.len());
    }

    /// Each list of `other`, in order, as the next lists.
    pub(crate) fn append(&mut self, other: &Lists) {
        let base = self.items.len();
        self.items.extend_from_slice(&other.items);
        self.start.extend(other.start[1..].iter().map(|s| base + s));
    }

    pub(crate) fn len(&self) -> usize {
        self.start.len() - 1
    }

    /// List `i` (empty past the last).
    pub(crate) fn get(&self, i: usize) -> &[usize] {
        match (self.start.get(i), self.start.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.items[a..b],
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Lists;

    #[test]
    fn lists_keep_their_items_in_order() {
        assert_eq!(Lists::default().len(), 0);
        let l = Lists::of([&[3, 1][..], &[], &[2]]);
        assert_eq!((l.len(), l.get(0), l.get(1), l.get(2), l.get(3)), (3, &[3, 1][..], &[][..], &[2][..], &[][..]));
        let g = Lists::grouped(3, &[(2, 7), (0, 5), (2, 6)]);
        assert_eq!((g.len(), g.get(0), g.get(1), g.get(2)), (3, &[5][..], &[][..], &[7, 6][..]));
        let mut a = Lists::of([&[1][..]]);
        a.push_with(|items| items.extend([4, 2]));
        a.append(&g);
        assert_eq!((a.len(), a.get(0), a.get(1), a.get(2), a.get(3), a.get(4)), (5, &[1][..], &[4, 2][..], &[5][..], &[][..], &[7, 6][..]));
    }
}
