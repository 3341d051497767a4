//! The in-memory store: bounded in entries and in bytes (the least recently used go first),
//! with TTLs (expired entries are swept by `sweep` and never read). The embedded default for a single replica, and the fallback while Redis is down.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Backend, StoreError};
use crate::bounded::ByteLru;

enum Item {
    Bytes(Vec<u8>),
    List(VecDeque<Vec<u8>>),
}

struct Entry {
    item: Item,
    expires: Instant,
}

impl Entry {
    /// The bytes the entry holds beside its key.
    fn bytes(&self) -> usize {
        match &self.item {
            Item::Bytes(bytes) => bytes.len(),
            Item::List(list) => list_bytes(list),
        }
    }
}

/// A list's values, and the vector each is.
fn list_bytes(list: &VecDeque<Vec<u8>>) -> usize {
    list.iter()
        .map(|v| v.len() + std::mem::size_of::<Vec<u8>>())
        .sum()
}

pub struct MemoryBackend {
    entries: Mutex<ByteLru<String, Entry>>,
    max_entries: usize,
}

impl MemoryBackend {
    pub fn new(max_entries: usize, max_bytes: usize) -> MemoryBackend {
        MemoryBackend {
            entries: Mutex::new(ByteLru::new(max_bytes, None)),
            max_entries: max_entries.max(1),
        }
    }

    #[cfg(test)]
    pub fn entry_count(&self) -> usize {
        self.entries.lock().map_or(0, |e| e.len())
    }

    /// Bytes held (keys, values and the per-entry overhead).
    pub fn bytes(&self) -> usize {
        self.entries.lock().map_or(0, |e| e.bytes())
    }

    /// Drops the expired entries (the TTLs are also checked on every read).
    pub fn sweep(&self, now: Instant) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.retain(|e| e.expires > now);
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut ByteLru<String, Entry>) -> T) -> Result<T, StoreError> {
        let mut entries = self.entries.lock().map_err(|_| StoreError::Poisoned)?;
        Ok(f(&mut entries))
    }

    /// Makes room for one more entry: the least recently used goes (expired entries are swept
    /// every few seconds and on every read; the byte bound evicts on insertion).
    fn make_room(&self, entries: &mut ByteLru<String, Entry>) {
        while entries.len() >= self.max_entries {
            if !entries.remove_least_recent() {
                break;
            }
        }
    }

    fn live<'a>(entries: &'a mut ByteLru<String, Entry>, key: &str) -> Option<&'a mut Entry> {
        let now = Instant::now();
        if entries.get(key).is_some_and(|e| e.expires <= now) {
            entries.remove(key);
        }
        entries.get_mut(key)
    }

    fn insert(entries: &mut ByteLru<String, Entry>, key: &str, entry: Entry) {
        let bytes = key.len() + entry.bytes();
        entries.insert(key.to_owned(), entry, bytes);
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
            if entries.get(key).is_none() {
                self.make_room(entries);
            }
            let entry = Entry {
                item: Item::Bytes(value.to_vec()),
                expires: Instant::now() + ttl,
            };
            Self::insert(entries, key, entry);
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
                    let bytes = key.len() + list_bytes(list);
                    entries.resize(key, bytes);
                }
                _ => {
                    self.make_room(entries);
                    let list = VecDeque::from([value.to_vec()]);
                    let entry = Entry {
                        item: Item::List(list),
                        expires,
                    };
                    Self::insert(entries, key, entry);
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
