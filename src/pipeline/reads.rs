//! A tool result's content under its envelopes (`payload::read`), read once and shared by
//! every stage that reads it: the ledger's identifiers, and each form the compaction makes
//! (stub, cuts at each budget step, working-set form). Parsing a large result is among the
//! costliest steps of a cold request: it is done once per rewrite, once per process when large.

use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::quality::FixedState;
use foldhash::{HashMap, HashMapExt};
use serde_json::Value;

use super::memo::Memo;
use super::payload::{self, Payload};

/// A result's content as `payload::read` finds it under its envelopes, kept for every form
/// made of it (stub, cuts, working-set form): a tree, or a text (`None`: the result itself).
pub(super) enum Read {
    Tree(Value),
    Text(Option<String>),
}

impl Read {
    pub(super) fn tree(&self) -> Option<&Value> {
        match self {
            Read::Tree(value) => Some(value),
            Read::Text(_) => None,
        }
    }

    pub(super) fn of(text: &str) -> Read {
        match payload::read(text) {
            Payload::Tree(value) => Read::Tree(value),
            Payload::Text(std::borrow::Cow::Borrowed(_)) => Read::Text(None),
            Payload::Text(std::borrow::Cow::Owned(inner)) => Read::Text(Some(inner)),
        }
    }
}

impl crate::bounded::Weigh for Read {
    fn heap_bytes(&self) -> usize {
        match self {
            Read::Tree(value) => value.heap_bytes(),
            Read::Text(inner) => inner.as_ref().map_or(0, String::capacity),
        }
    }
}

/// Seed of the memo keys of read results.
const READ_SEED: u64 = 0x7265_6164_0000_0001;

/// From this size on a result's tree stays in the memo across requests: reading it again costs
/// tens of microseconds or more. A smaller result's tree (about three times its text) is kept
/// only while the rewrite that read it runs (`ReadScope`), and read again when a later request
/// makes a new form of it.
const READ_MEMO_MIN_BYTES: usize = 16 * 1024;

/// Small results read by one rewrite, by the hash of their text.
type Reads = HashMap<u64, Arc<Read>>;

thread_local! {
    /// The small results read by the rewrite this thread is running, when a `ReadScope` is
    /// open: its identifiers and its forms (working set, cuts at each budget step, stub) share
    /// one read.
    static READS: std::cell::RefCell<Option<Reads>> = const { std::cell::RefCell::new(None) };
}

/// While it lives, the small results that the stages read on this thread are read once
/// (`READS`); they go when it drops. Opened by each pipeline run; an inner scope is a no-op.
pub struct ReadScope {
    opened: bool,
}

impl ReadScope {
    pub fn enter() -> ReadScope {
        let opened = with_reads(|reads| match reads {
            None => {
                *reads = Some(HashMap::new());
                true
            }
            Some(_) => false,
        });
        ReadScope {
            opened: opened.unwrap_or(false),
        }
    }
}

impl Drop for ReadScope {
    fn drop(&mut self) {
        if self.opened {
            with_reads(|reads| *reads = None);
        }
    }
}

/// `f` over this thread's reads; `None` when they are in use (never: nothing here nests).
fn with_reads<T>(f: impl FnOnce(&mut Option<Reads>) -> T) -> Option<T> {
    READS.with(|reads| reads.try_borrow_mut().ok().map(|mut reads| f(&mut reads)))
}

/// `Read::of`, memoized by the text: in the memo from `READ_MEMO_MIN_BYTES` on,
/// else in the open `ReadScope` (read again outside one).
pub(super) fn read(text: &str, memo: &Memo) -> Arc<Read> {
    let key = FixedState::with_seed(READ_SEED).hash_one(text);
    if text.len() >= READ_MEMO_MIN_BYTES {
        return memo.value(key, || Read::of(text));
    }
    let known = with_reads(|reads| reads.as_ref().and_then(|reads| reads.get(&key).cloned()));
    if let Some(read) = known.flatten() {
        return read;
    }
    let read = Arc::new(Read::of(text));
    with_reads(|reads| {
        if let Some(reads) = reads {
            reads.insert(key, Arc::clone(&read));
        }
    });
    read
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn a_small_result_is_read_once_per_rewrite_and_a_large_one_once_per_process() {
        let memo = Memo::default();
        let small = json!({"order_id": "#W1", "status": "pending"}).to_string();
        let items: Vec<_> = (0..800)
            .map(|i| json!({"item_id": i, "sku": "A"}))
            .collect();
        let large = serde_json::to_string(&items).unwrap();
        assert!(small.len() < READ_MEMO_MIN_BYTES && large.len() >= READ_MEMO_MIN_BYTES);

        // Outside a rewrite, a small result is read each time, and nothing stays in the memo.
        let (a, b) = (read(&small, &memo), read(&small, &memo));
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(memo.bytes().0, 0);
        let first = {
            let _rewrite = ReadScope::enter();
            let first = read(&small, &memo);
            {
                // A scope opened inside another (an earlier point's rewrite) shares its reads.
                let _inner = ReadScope::enter();
                assert!(Arc::ptr_eq(&first, &read(&small, &memo)));
            }
            assert!(Arc::ptr_eq(&first, &read(&small, &memo)));
            assert!(first.tree().is_some());
            first
        };
        // The scope's reads went with it.
        assert!(!Arc::ptr_eq(&first, &read(&small, &memo)));
        assert!(READS.with(|reads| reads.borrow().is_none()));
        assert_eq!(memo.bytes().0, 0);

        let kept = read(&large, &memo);
        assert!(Arc::ptr_eq(&kept, &read(&large, &memo)));
        assert!(memo.bytes().0 > large.len());
    }
}
