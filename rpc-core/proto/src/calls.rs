//! A table of calls (or buffers) by id, indexed by the id's low bits.
//!
//! Call ids are handed out in sequence, so the calls in flight at one time have distinct low
//! bits nearly always: an array indexed by them finds a call with one comparison and no hash.
//! A table of a few calls is looked up several times per message on both sides (the session's
//! calls and served requests, the client's results), where a hash map's insert and removal
//! cost more than the rest of the lookups together. An id whose index is taken by another live
//! call (a long call overtaken by a full table of later ones, or ids a peer chose) goes to an
//! overflow hash map, so any ids work; the array doubles when half full, up to [`MAX_DIRECT`].

use foldhash::HashMap;
use std::hash::Hash;

/// An id: a call's (`u32`) or a buffer's (`u64`), whose low bits index the array.
pub trait Key: Copy + Eq + Hash {
    /// The id's low bits (as many as fit a `usize`).
    fn low(self) -> usize;
}

impl Key for u32 {
    fn low(self) -> usize {
        self as usize
    }
}

impl Key for u64 {
    fn low(self) -> usize {
        // Only the low bits index: the truncation is the point.
        self as usize
    }
}

/// Initial slots of the array.
const INITIAL: usize = 16;

/// The array grows no further (calls beyond go to the overflow map): a peer choosing its ids
/// cannot make it large.
const MAX_DIRECT: usize = 1 << 14;

/// Calls (or buffers) by id, indexed by the id's low bits: ids handed out in sequence find
/// their entry with one comparison and no hash; an id whose index another live entry holds goes
/// to an overflow hash map, so any ids work.
pub struct CallMap<K, V> {
    /// `slots.len()` is a power of two; an entry sits at `id & (len - 1)` or in `overflow`.
    slots: Vec<Option<(K, V)>>,
    overflow: HashMap<K, V>,
    /// Entries in `slots` (not counting `overflow`).
    direct: usize,
}

impl<K, V> Default for CallMap<K, V> {
    fn default() -> Self {
        Self {
            slots: std::iter::repeat_with(|| None).take(INITIAL).collect(),
            overflow: HashMap::default(),
            direct: 0,
        }
    }
}

impl<K: Key, V> CallMap<K, V> {
    #[inline]
    fn index(&self, id: K) -> usize {
        id.low() & (self.slots.len() - 1)
    }

    /// Number of calls.
    pub fn len(&self) -> usize {
        self.direct + self.overflow.len()
    }

    /// Whether there are no calls.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `id` is in the table.
    #[inline]
    pub fn contains_key(&self, id: K) -> bool {
        self.get(id).is_some()
    }

    /// The call `id`.
    #[inline]
    pub fn get(&self, id: K) -> Option<&V> {
        match &self.slots[self.index(id)] {
            Some((k, v)) if *k == id => Some(v),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(&id),
        }
    }

    /// The call `id`, to change.
    #[inline]
    pub fn get_mut(&mut self, id: K) -> Option<&mut V> {
        let i = self.index(id);
        let here = matches!(&self.slots[i], Some((k, _)) if *k == id);
        if here {
            return self.slots[i].as_mut().map(|(_, v)| v);
        }
        if self.overflow.is_empty() {
            return None;
        }
        self.overflow.get_mut(&id)
    }

    /// Adds `v` as call `id`; gives back the value it replaces.
    #[inline]
    pub fn insert(&mut self, id: K, v: V) -> Option<V> {
        if let Some(old) = self.get_mut(id) {
            return Some(std::mem::replace(old, v));
        }
        if self.direct >= self.slots.len() / 2 && self.slots.len() < MAX_DIRECT {
            self.grow();
        }
        self.place(id, v);
        None
    }

    /// Puts an entry not in the table where it belongs (the array, else the overflow map).
    fn place(&mut self, id: K, v: V) {
        let i = self.index(id);
        match &mut self.slots[i] {
            slot @ None => {
                *slot = Some((id, v));
                self.direct += 1;
            }
            Some(_) => {
                self.overflow.insert(id, v);
            }
        }
    }

    /// Doubles the array and puts every entry where it belongs in it.
    fn grow(&mut self) {
        let n = self.slots.len() * 2;
        let old = std::mem::replace(&mut self.slots, std::iter::repeat_with(|| None).take(n).collect());
        let spilled = std::mem::take(&mut self.overflow);
        self.direct = 0;
        for (id, v) in old.into_iter().flatten().chain(spilled) {
            self.place(id, v);
        }
    }

    /// Takes call `id` out.
    #[inline]
    pub fn remove(&mut self, id: K) -> Option<V> {
        let i = self.index(id);
        if matches!(&self.slots[i], Some((k, _)) if *k == id) {
            self.direct -= 1;
            return self.slots[i].take().map(|(_, v)| v);
        }
        if self.overflow.is_empty() {
            return None;
        }
        self.overflow.remove(&id)
    }

    /// Every call, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (K, &V)> {
        let direct = self.slots.iter().flatten().map(|(k, v)| (*k, v));
        direct.chain(self.overflow.iter().map(|(k, v)| (*k, v)))
    }

    /// Every call's value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// Takes every call out.
    pub fn drain(&mut self) -> Vec<(K, V)> {
        self.direct = 0;
        let mut all: Vec<(K, V)> = self.slots.iter_mut().filter_map(Option::take).collect();
        all.extend(self.overflow.drain());
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32, u32),
        Remove(u32),
        Get(u32),
        Bump(u32),
        Drain,
    }

    /// Ids close together (as a session hands them out) and ids far apart (as a peer may
    /// choose them), so that both the array and the overflow map are exercised.
    fn id() -> impl Strategy<Value = u32> {
        prop_oneof![
            0u32..40,
            (0u32..8).prop_map(|k| k * 16 + 3),
            any::<u32>(),
            (0u32..4).prop_map(|k| k << 14)
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (id(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => id().prop_map(Op::Remove),
            2 => id().prop_map(Op::Get),
            2 => id().prop_map(Op::Bump),
            1 => Just(Op::Drain),
        ]
    }

    fn sorted(m: &CallMap<u32, u32>) -> Vec<(u32, u32)> {
        let mut v: Vec<_> = m.iter().map(|(k, v)| (k, *v)).collect();
        v.sort_unstable();
        v
    }

    proptest! {
        /// The table behaves as a map: every operation answers as a `BTreeMap` does.
        #[test]
        fn the_table_answers_as_a_map_does(ops in proptest::collection::vec(op(), 1..300)) {
            let mut m = CallMap::default();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => prop_assert_eq!(m.insert(k, v), model.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(m.remove(k), model.remove(&k)),
                    Op::Get(k) => {
                        prop_assert_eq!(m.get(k), model.get(&k));
                        prop_assert_eq!(m.contains_key(k), model.contains_key(&k));
                    }
                    Op::Bump(k) => {
                        if let Some(v) = m.get_mut(k) {
                            *v = v.wrapping_add(1);
                        }
                        if let Some(v) = model.get_mut(&k) {
                            *v = v.wrapping_add(1);
                        }
                    }
                    Op::Drain => {
                        let mut got = m.drain();
                        got.sort_unstable();
                        let want: Vec<_> = std::mem::take(&mut model).into_iter().collect();
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert_eq!(m.len(), model.len());
                let want: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(sorted(&m), want);
            }
        }
    }

    #[test]
    fn ids_in_sequence_stay_in_the_array_and_it_grows_when_half_full() {
        let mut m = CallMap::default();
        for id in 1..=1000u32 {
            m.insert(id, id);
        }
        assert!(m.overflow.is_empty(), "sequential ids never collide");
        assert!(
            m.slots.len() >= 2000 && m.slots.len() <= 4096,
            "{} slots",
            m.slots.len()
        );
        // A long call overtaken by a table's worth of later ones shares its index with one.
        let mut m = CallMap::default();
        m.insert(1, 0);
        for id in 2..=8u32 {
            m.insert(id, id);
            m.remove(id);
        }
        m.insert(1 + INITIAL as u32, 7);
        assert_eq!(m.overflow.len(), 1);
        assert_eq!((m.get(1), m.get(1 + INITIAL as u32)), (Some(&0), Some(&7)));
        assert_eq!(m.remove(1 + INITIAL as u32), Some(7));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn ids_a_peer_chooses_cannot_grow_the_array_past_its_limit() {
        let mut m = CallMap::default();
        let n = MAX_DIRECT as u32 * 4;
        for id in 0..n {
            m.insert(id, id);
        }
        assert_eq!(m.slots.len(), MAX_DIRECT);
        assert_eq!((m.len(), m.direct), (n as usize, MAX_DIRECT));
        assert!((0..n).all(|id| m.get(id) == Some(&id)));
        assert!((0..n).step_by(3).all(|id| m.remove(id) == Some(id)));
        assert!((0..n).all(|id| m.contains_key(id) == (id % 3 != 0)));
    }
}
