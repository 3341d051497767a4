//! A message's text (and a tool's description), shared instead of copied: every stage, budget
//! step and earlier point of a conversation works on copies of the client's messages and tools,
//! and a copy of a 30 KB tool result should cost a reference count, not 30 KB. The text's digest
//! is taken once, when it is made: the memo and token-cache keys of its message or tool read it
//! instead of hashing the text again (a request's tool block is keyed at every count of it).

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};
use std::ops::Deref;
use std::sync::Arc;

use foldhash::quality::FixedState;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const DIGEST_SEED: u64 = 0x7465_7874_0001;

/// Immutable text behind a reference count; reads as a `&str`.
#[derive(Clone)]
pub struct SharedText(Arc<Inner>);

struct Inner {
    digest: u64,
    text: Box<str>,
}

impl SharedText {
    fn new(text: Box<str>) -> Self {
        let digest = SharedText::digest_of(&text);
        SharedText(Arc::new(Inner { digest, text }))
    }

    /// The digest a `SharedText` of `text` has.
    pub fn digest_of(text: &str) -> u64 {
        FixedState::with_seed(DIGEST_SEED).hash_one(text)
    }

    pub fn as_str(&self) -> &str {
        &self.0.text
    }

    /// A 64-bit digest of the text (taken when it was made): what keys hash for it.
    pub fn digest(&self) -> u64 {
        self.0.digest
    }
}

impl Default for SharedText {
    fn default() -> Self {
        SharedText::new(Box::default())
    }
}

impl PartialEq for SharedText {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.digest == other.0.digest && self.0.text == other.0.text)
    }
}

impl Eq for SharedText {}

/// Hashes as its digest, not as the `str` (it has no `Borrow<str>` for that reason).
impl Hash for SharedText {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.digest.hash(state);
    }
}

impl Deref for SharedText {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0.text
    }
}

impl AsRef<str> for SharedText {
    fn as_ref(&self) -> &str {
        &self.0.text
    }
}

impl From<String> for SharedText {
    fn from(text: String) -> Self {
        SharedText::new(text.into_boxed_str())
    }
}

impl From<&str> for SharedText {
    fn from(text: &str) -> Self {
        SharedText::new(Box::from(text))
    }
}

impl PartialEq<str> for SharedText {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for SharedText {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl Serialize for SharedText {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for SharedText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(SharedText::from)
    }
}

impl fmt::Debug for SharedText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for SharedText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_shares_the_text_and_equal_texts_digest_alike() {
        let text = SharedText::from("order #W123 shipped".to_owned());
        let copy = text.clone();
        assert!(std::ptr::eq(text.as_str(), copy.as_str()));
        let made_apart = SharedText::from("order #W123 shipped");
        assert_eq!(text, made_apart);
        assert_eq!(text.digest(), made_apart.digest());
        let hasher = FixedState::with_seed(7);
        assert_eq!(hasher.hash_one(&text), hasher.hash_one(&made_apart));
        let other = SharedText::from("order #W124 shipped");
        assert_ne!(text, other);
        assert_ne!(text.digest(), other.digest());
        assert_eq!(text, "order #W123 shipped");
        assert_eq!(format!("{text:?}"), "\"order #W123 shipped\"");
        assert_eq!(SharedText::default().as_str(), "");
    }
}
