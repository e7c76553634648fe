//! A map of a few entries, kept as a Vec sorted by key: a group's AZs, an
//! AZ's nodes by state, its streaks by metric.
//!
//! A `BTreeMap` allocates a node with room for eleven entries however few it
//! holds: with 10,000 groups of 3 AZs, those maps held about 50 MiB of the
//! daemon's heap (heaptrack, bench/daemon_scale.sh); with this map its
//! resident memory fell by about as much (docs/scaling.md).
//! Lookups are a binary search; it serializes as a JSON object, in key order,
//! as the `BTreeMap` did.

use serde::ser::{Serialize, SerializeMap, Serializer};
use std::borrow::Borrow;

#[derive(Debug, Clone)]
pub struct SmallMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for SmallMap<K, V> {
    fn default() -> Self {
        SmallMap(Vec::new())
    }
}

impl<K: Ord, V> SmallMap<K, V> {
    pub fn new() -> Self {
        Self::default()
    }

    fn position<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.0.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    #[cfg(test)]
    pub fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.position(key).ok().map(|i| &self.0[i].1)
    }

    pub fn get_mut<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.position(key).ok().map(|i| &mut self.0[i].1)
    }

    pub fn contains_key<Q: Ord + ?Sized>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
    {
        self.position(key).is_ok()
    }

    /// Sets `key`'s value, returning the one it replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.position(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    /// Takes `key`'s entry out; the last one out frees the map's memory
    /// (a group's restored AZ states are taken one by one, then never again).
    pub fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let (_, value) = self.0.remove(self.position(key).ok()?);
        if self.0.is_empty() {
            self.0 = Vec::new();
        }
        Some(value)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.0.retain_mut(|(k, v)| keep(k, v));
    }

    /// Frees the map's memory too (a group let go keeps its runtime).
    pub fn clear(&mut self) {
        self.0 = Vec::new();
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The entries in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }
}

/// As a `BTreeMap` collects: the last value of a key repeated wins. The Vec
/// is as long as the entries, with no room to spare.
impl<K: Ord, V> FromIterator<(K, V)> for SmallMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(entries: I) -> Self {
        let mut map = SmallMap::new();
        for (k, v) in entries {
            map.insert(k, v);
        }
        map.0.shrink_to_fit();
        map
    }
}

impl<'a, K: Ord, V> IntoIterator for &'a SmallMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&'a (K, V)) -> (&'a K, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl<K: Serialize, V: Serialize> Serialize for SmallMap<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::SmallMap;
    use std::collections::BTreeMap;

    /// The same answers as a BTreeMap given the same edits, whatever their order.
    #[test]
    fn it_answers_as_a_btreemap_does() {
        let edits = [("c", 1), ("a", 2), ("b", 3), ("a", 4), ("d", 5), ("c", 6)];
        let mut small = SmallMap::new();
        let mut tree = BTreeMap::new();
        for (k, v) in edits {
            assert_eq!(
                small.insert(k.to_string(), v),
                tree.insert(k.to_string(), v)
            );
        }
        assert_eq!(small.len(), tree.len());
        assert!(small.iter().eq(tree.iter()), "in key order");
        for k in ["a", "b", "c", "d", "e"] {
            assert_eq!(small.get(k), tree.get(k), "{k}");
            assert_eq!(small.contains_key(k), tree.contains_key(k), "{k}");
        }
        *small.get_mut("b").unwrap() += 10;
        *tree.get_mut("b").unwrap() += 10;
        small.retain(|k, _| k != "c");
        tree.retain(|k, _| k != "c");
        assert!(small.iter().eq(tree.iter()));
        assert_eq!(
            serde_json::to_string(&small).unwrap(),
            serde_json::to_string(&tree).unwrap(),
            "the same JSON object"
        );
        let three_azs = [("az2", 1), ("az1", 2), ("az3", 3), ("az1", 4)];
        let collected: SmallMap<_, _> = three_azs.into_iter().collect();
        let expected: BTreeMap<_, _> = three_azs.into_iter().collect();
        assert!(
            (&collected).into_iter().eq(expected.iter()),
            "the last of a key wins"
        );
        assert_eq!(collected.0.capacity(), 3, "no room to spare");
        assert!(collected.values().eq(expected.values()));
        assert_eq!(small.remove("a"), tree.remove("a"));
        assert_eq!(small.remove("a"), None);
        assert!(small.iter().eq(tree.iter()));
        small.remove("b");
        small.remove("d");
        assert!(small.is_empty() && small.values().next().is_none());
        assert_eq!(small.0.capacity(), 0, "emptied, it holds no memory");
        let mut cleared = collected.clone();
        cleared.clear();
        assert!(cleared.is_empty());
        assert_eq!(cleared.0.capacity(), 0, "cleared, it holds no memory");
    }
}
