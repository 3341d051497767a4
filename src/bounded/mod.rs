//! Maps bounded in bytes: every cache and memo the process keeps is one, so that memory stays
//! bounded whatever the traffic. The least recently used entry goes first when a map is full,
//! and entries nobody asked for during `idle` are swept, so an idle proxy gives memory back.

pub mod config;

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use config::MemoryConfig;

/// What an entry costs beside its key and value: the map's slot and the LRU list's node.
pub const ENTRY_OVERHEAD: usize = 64;

/// A least-recently-used map that holds at most `max_bytes`, counted by what each insertion
/// declares.
pub struct ByteLru<K, V> {
    map: lru::LruCache<K, Slot<V>, foldhash::fast::RandomState>,
    bytes: usize,
    max_bytes: usize,
    idle: Option<Duration>,
    /// When each period between two sweeps began, oldest first: an entry records the period of
    /// its last use, so an access reads no clock. Only the periods of the entries left are kept.
    periods: VecDeque<Instant>,
    /// The number of the period `periods[0]` began.
    first_period: u64,
}

struct Slot<V> {
    value: V,
    bytes: usize,
    /// The period of its last use.
    used: u64,
}

impl<K: Hash + Eq, V> ByteLru<K, V> {
    /// A map of at most `max_bytes`; with `idle`, entries unused that long are swept.
    pub fn new(max_bytes: usize, idle: Option<Duration>) -> ByteLru<K, V> {
        ByteLru {
            map: lru::LruCache::unbounded_with_hasher(Default::default()),
            bytes: 0,
            max_bytes,
            idle,
            periods: VecDeque::from([Instant::now()]),
            first_period: 0,
        }
    }

    /// The period since the last sweep.
    fn period(&self) -> u64 {
        self.first_period + self.periods.len() as u64 - 1
    }

    /// The value for `key`, now the most recently used.
    pub fn get<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.get_mut(key).map(|v| &*v)
    }

    /// The value for `key`, now the most recently used, to change in place (then `resize` if
    /// its size changed).
    pub fn get_mut<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        let period = self.period();
        let slot = self.map.get_mut(key)?;
        slot.used = period;
        Some(&mut slot.value)
    }

    /// Keeps `value` as `bytes` (its own size; the key and the overhead are added), evicting
    /// the least recently used entries to make room. A value larger than the whole map is not
    /// kept: `false`.
    pub fn insert(&mut self, key: K, value: V, bytes: usize) -> bool {
        let bytes = bytes + std::mem::size_of::<K>() + std::mem::size_of::<V>() + ENTRY_OVERHEAD;
        self.remove(&key);
        if bytes > self.max_bytes {
            return false;
        }
        self.evict_to(self.max_bytes - bytes);
        let used = self.period();
        self.map.put(key, Slot { value, bytes, used });
        self.bytes += bytes;
        true
    }

    /// Records that the value of `key` now holds `bytes` (as `insert` counts them), evicting
    /// others (or it) to stay within the bound.
    pub fn resize<Q: Hash + Eq + ?Sized>(&mut self, key: &Q, bytes: usize)
    where
        K: Borrow<Q>,
    {
        let bytes = bytes + std::mem::size_of::<K>() + std::mem::size_of::<V>() + ENTRY_OVERHEAD;
        let Some(slot) = self.map.peek_mut(key) else {
            return;
        };
        self.bytes = self.bytes - slot.bytes + bytes;
        slot.bytes = bytes;
        if bytes > self.max_bytes {
            self.remove(key);
        }
        self.evict_to(self.max_bytes);
    }

    pub fn remove<Q: Hash + Eq + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let slot = self.map.pop(key)?;
        self.bytes -= slot.bytes;
        Some(slot.value)
    }

    /// Evicts the least recently used entry; `false` when there was none.
    pub fn remove_least_recent(&mut self) -> bool {
        match self.map.pop_lru() {
            Some((_, slot)) => {
                self.bytes -= slot.bytes;
                true
            }
            None => false,
        }
    }

    /// Keeps only the entries for which `keep` holds (e.g. drops expired ones), in their order:
    /// one pass over the entries, then one removal for each that goes.
    pub fn retain(&mut self, mut keep: impl FnMut(&V) -> bool)
    where
        K: Clone,
    {
        let gone: Vec<K> = self
            .map
            .iter()
            .filter(|(_, slot)| !keep(&slot.value))
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            self.remove(&key);
        }
    }

    /// Drops the entries unused for longer than the map's `idle` (none without one), counted
    /// from the end of the period of their last use: an entry goes between `idle` and `idle`
    /// plus one period between sweeps after it was last used.
    pub fn sweep(&mut self, now: Instant) {
        let Some(idle) = self.idle else {
            return;
        };
        let ended = Instant::now();
        // A period ends where the next one begins; the current one, now.
        let end_of = |period: u64, periods: &VecDeque<Instant>, first: u64| {
            let next = period.saturating_add(1).saturating_sub(first);
            usize::try_from(next)
                .ok()
                .and_then(|next| periods.get(next).copied())
                .unwrap_or(ended)
        };
        while let Some((_, slot)) = self.map.peek_lru() {
            let last_used = end_of(slot.used, &self.periods, self.first_period);
            if now.saturating_duration_since(last_used) <= idle {
                break;
            }
            if let Some((_, slot)) = self.map.pop_lru() {
                self.bytes -= slot.bytes;
            }
        }
        self.periods.push_back(ended);
        // The periods before the least recently used entry's no longer speak for any entry.
        let oldest = self.map.peek_lru().map_or(self.period(), |(_, s)| s.used);
        while self.first_period < oldest && self.periods.len() > 1 {
            self.periods.pop_front();
            self.first_period += 1;
        }
        if self.map.is_empty() {
            // Give back the table itself, not only its entries.
            self.map = lru::LruCache::unbounded_with_hasher(Default::default());
        }
    }

    /// Bytes held, as declared plus the per-entry overhead.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn evict_to(&mut self, at_most: usize) {
        while self.bytes > at_most && self.remove_least_recent() {}
    }
}

/// A `ByteLru` shared between threads. A poisoned lock only costs the caching.
pub struct SharedLru<K, V> {
    inner: Mutex<ByteLru<K, V>>,
}

impl<K: Hash + Eq, V: Clone> SharedLru<K, V> {
    pub fn new(max_bytes: usize, idle: Option<Duration>) -> SharedLru<K, V> {
        SharedLru {
            inner: Mutex::new(ByteLru::new(max_bytes, idle)),
        }
    }

    pub fn get(&self, key: &K) -> Option<V> {
        self.inner.lock().ok()?.get(key).cloned()
    }

    /// The value for `key`, made by `make` on a miss and kept as `weigh` of it bytes. The lock
    /// is not held while `make` runs.
    pub fn get_or_make(&self, key: K, make: impl FnOnce() -> V, weigh: impl Fn(&V) -> usize) -> V {
        if let Some(hit) = self.get(&key) {
            return hit;
        }
        let value = make();
        let bytes = weigh(&value);
        if let Ok(mut map) = self.inner.lock() {
            map.insert(key, value.clone(), bytes);
        }
        value
    }

    /// Keeps `value` as `bytes` (see `ByteLru::insert`).
    pub fn insert(&self, key: K, value: V, bytes: usize) {
        if let Ok(mut map) = self.inner.lock() {
            map.insert(key, value, bytes);
        }
    }

    pub fn remove(&self, key: &K) -> Option<V> {
        self.inner.lock().ok()?.remove(key)
    }

    pub fn sweep(&self, now: Instant) {
        if let Ok(mut map) = self.inner.lock() {
            map.sweep(now);
        }
    }

    pub fn bytes(&self) -> usize {
        self.inner.lock().map_or(0, |m| m.bytes())
    }
}

/// What a value holds on the heap, about: what a cache counts it as, beside its own size.
pub trait Weigh {
    fn heap_bytes(&self) -> usize;
}

impl Weigh for usize {
    fn heap_bytes(&self) -> usize {
        0
    }
}

impl Weigh for f64 {
    fn heap_bytes(&self) -> usize {
        0
    }
}

impl Weigh for u32 {
    fn heap_bytes(&self) -> usize {
        0
    }
}

impl Weigh for String {
    fn heap_bytes(&self) -> usize {
        self.capacity()
    }
}

impl<A: Weigh, B: Weigh> Weigh for (A, B) {
    fn heap_bytes(&self) -> usize {
        self.0.heap_bytes() + self.1.heap_bytes()
    }
}

impl<T: Weigh> Weigh for [T] {
    fn heap_bytes(&self) -> usize {
        self.iter()
            .map(|t| std::mem::size_of::<T>() + t.heap_bytes())
            .sum()
    }
}

impl<T: Weigh> Weigh for Vec<T> {
    fn heap_bytes(&self) -> usize {
        self.as_slice().heap_bytes() + (self.capacity() - self.len()) * std::mem::size_of::<T>()
    }
}

impl Weigh for serde_json::Value {
    fn heap_bytes(&self) -> usize {
        use serde_json::Value;
        match self {
            Value::String(s) => s.capacity(),
            Value::Array(items) => items.heap_bytes(),
            Value::Object(map) => map.heap_bytes(),
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        }
    }
}

impl Weigh for serde_json::Map<String, serde_json::Value> {
    /// An ordered map: its entries, and an index slot each.
    fn heap_bytes(&self) -> usize {
        self.iter()
            .map(|(k, v)| {
                k.capacity()
                    + std::mem::size_of::<(String, serde_json::Value)>()
                    + 16
                    + v.heap_bytes()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overhead() -> usize {
        std::mem::size_of::<u64>() + std::mem::size_of::<u32>() + ENTRY_OVERHEAD
    }

    #[test]
    fn evicts_the_least_recently_used_to_stay_within_its_bytes() {
        let mut map: ByteLru<u64, u32> = ByteLru::new(3 * (100 + overhead()), None);
        assert!(map.insert(1, 1, 100));
        assert!(map.insert(2, 2, 100));
        assert!(map.insert(3, 3, 100));
        assert_eq!(map.get(&1), Some(&1)); // 2 is now the least recently used
        assert!(map.insert(4, 4, 100));
        assert_eq!(map.get(&2), None);
        for key in [1, 3, 4] {
            assert_eq!(map.get(&key), Some(&(key as u32)));
        }
        assert_eq!(map.bytes(), 3 * (100 + overhead()));
        // A big one makes room for itself by evicting as many as it takes.
        assert!(map.insert(5, 5, 350));
        assert_eq!(map.len(), 1);
        assert_eq!(map.bytes(), 350 + overhead());
    }

    #[test]
    fn never_keeps_a_value_larger_than_the_whole_map() {
        let mut map: ByteLru<u64, u32> = ByteLru::new(1_000, None);
        assert!(map.insert(1, 1, 10));
        assert!(!map.insert(2, 2, 10_000));
        assert_eq!(map.get(&1), Some(&1));
        assert_eq!(map.get(&2), None);
        // Replacing a key replaces its bytes.
        assert!(map.insert(1, 7, 20));
        assert_eq!(map.bytes(), 20 + overhead());
    }

    #[test]
    fn resize_counts_growth_and_evicts() {
        let mut map: ByteLru<u64, u32> = ByteLru::new(2 * (100 + overhead()), None);
        map.insert(1, 1, 100);
        map.insert(2, 2, 100);
        map.resize(&2, 150);
        assert_eq!(map.get(&1), None);
        assert_eq!(map.bytes(), 150 + overhead());
        map.resize(&2, 10_000);
        assert!(map.is_empty());
        assert_eq!(map.bytes(), 0);
    }

    #[test]
    fn sweeps_what_was_not_used_within_idle() {
        let mut map: ByteLru<u64, u32> = ByteLru::new(1 << 20, Some(Duration::from_secs(60)));
        map.insert(1, 1, 10);
        map.insert(2, 2, 10);
        let now = Instant::now();
        map.sweep(now);
        assert_eq!(map.len(), 2);
        map.sweep(now + Duration::from_secs(61));
        assert!(map.is_empty());
        assert_eq!(map.bytes(), 0);
        // Entries of the period before the last sweep and of the current one: each kept until
        // `idle` after its period ended, and the periods of no entry forgotten.
        map.insert(3, 3, 10);
        map.sweep(Instant::now());
        map.insert(4, 4, 10);
        let later = Instant::now() + Duration::from_secs(30);
        map.sweep(later);
        assert_eq!(map.len(), 2);
        assert_eq!(map.periods.len(), 3);
        map.sweep(later + Duration::from_secs(31));
        assert!(map.is_empty());
        assert_eq!(map.periods.len(), 1);
        // Without an idle time nothing is swept.
        let mut kept: ByteLru<u64, u32> = ByteLru::new(1 << 20, None);
        kept.insert(1, 1, 10);
        kept.sweep(now + Duration::from_secs(3_600));
        assert_eq!(kept.len(), 1);
    }

    #[test]
    fn retain_drops_what_fails_and_its_bytes() {
        let mut map: ByteLru<u64, u32> = ByteLru::new(1 << 20, None);
        for i in 0..10 {
            map.insert(i, i as u32, 10);
        }
        map.retain(|v| v % 2 == 0);
        assert_eq!(map.len(), 5);
        assert_eq!(map.bytes(), 5 * (10 + overhead()));
        assert_eq!(map.get(&3), None);
        assert_eq!(map.get(&4), Some(&4));
    }

    #[test]
    fn shared_makes_once_and_weighs() {
        let map: SharedLru<u64, String> = SharedLru::new(1 << 20, None);
        let a = map.get_or_make(1, || "one".into(), |v| v.len());
        let b = map.get_or_make(1, || unreachable!("kept"), |v| v.len());
        assert_eq!((a.as_str(), b.as_str()), ("one", "one"));
        assert_eq!(
            map.bytes(),
            3 + std::mem::size_of::<u64>() + std::mem::size_of::<String>() + ENTRY_OVERHEAD
        );
    }
}
