//! The in-memory store: bounded, with TTLs. The embedded default for a single replica, and the
//! fallback while Redis is down.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Backend, StoreError};

enum Item {
    Bytes(Vec<u8>),
    List(VecDeque<Vec<u8>>),
}

struct Entry {
    item: Item,
    expires: Instant,
}

pub struct MemoryBackend {
    entries: Mutex<HashMap<String, Entry>>,
    max_entries: usize,
}

impl MemoryBackend {
    pub fn new(max_entries: usize) -> MemoryBackend {
        MemoryBackend {
            entries: Mutex::new(HashMap::new()),
            max_entries: max_entries.max(1),
        }
    }

    #[cfg(test)]
    pub fn entry_count(&self) -> usize {
        self.entries.lock().map_or(0, |e| e.len())
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Entry>) -> T) -> Result<T, StoreError> {
        let mut entries = self.entries.lock().map_err(|_| StoreError::Poisoned)?;
        Ok(f(&mut entries))
    }

    /// Makes room for one more entry: expired ones go first, then the tenth of the entries
    /// that expire soonest.
    fn make_room(&self, entries: &mut HashMap<String, Entry>) {
        if entries.len() < self.max_entries {
            return;
        }
        let now = Instant::now();
        entries.retain(|_, e| e.expires > now);
        if entries.len() < self.max_entries {
            return;
        }
        let mut by_expiry: Vec<(Instant, String)> = entries
            .iter()
            .map(|(k, e)| (e.expires, k.clone()))
            .collect();
        by_expiry.sort();
        let evict = (self.max_entries / 10).max(1);
        for (_, key) in by_expiry.into_iter().take(evict) {
            entries.remove(&key);
        }
    }

    fn live<'a>(entries: &'a mut HashMap<String, Entry>, key: &str) -> Option<&'a mut Entry> {
        let now = Instant::now();
        if entries.get(key).is_some_and(|e| e.expires <= now) {
            entries.remove(key);
        }
        entries.get_mut(key)
    }
}

impl Backend for MemoryBackend {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.with(|entries| match Self::live(entries, key) {
            Some(Entry {
                item: Item::Bytes(bytes),
                ..
            }) => Some(bytes.clone()),
            _ => None,
        })
    }

    async fn set(&self, key: &str, value: &[u8], ttl: Duration) -> Result<(), StoreError> {
        self.with(|entries| {
            if !entries.contains_key(key) {
                self.make_room(entries);
            }
            entries.insert(
                key.to_owned(),
                Entry {
                    item: Item::Bytes(value.to_vec()),
                    expires: Instant::now() + ttl,
                },
            );
        })
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.with(|entries| {
            entries.remove(key);
        })
    }

    async fn push_capped(
        &self,
        key: &str,
        value: &[u8],
        max_len: usize,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.with(|entries| {
            let expires = Instant::now() + ttl;
            match Self::live(entries, key) {
                Some(Entry {
                    item: Item::List(list),
                    expires: at,
                }) => {
                    list.push_front(value.to_vec());
                    list.truncate(max_len);
                    *at = expires;
                }
                _ => {
                    self.make_room(entries);
                    let list = VecDeque::from([value.to_vec()]);
                    entries.insert(
                        key.to_owned(),
                        Entry {
                            item: Item::List(list),
                            expires,
                        },
                    );
                }
            }
        })
    }

    async fn list(&self, key: &str) -> Result<Vec<Vec<u8>>, StoreError> {
        self.with(|entries| match Self::live(entries, key) {
            Some(Entry {
                item: Item::List(list),
                ..
            }) => list.iter().cloned().collect(),
            _ => Vec::new(),
        })
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
