//! A message's text, shared instead of copied: every stage, budget step and earlier point of a
//! conversation works on copies of the client's messages, and a copy of a 30 KB tool result
//! should cost a reference count, not 30 KB.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Immutable text behind a reference count; reads as a `&str`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SharedText(Arc<str>);

impl SharedText {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for SharedText {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SharedText {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for SharedText {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<String> for SharedText {
    fn from(text: String) -> Self {
        SharedText(Arc::from(text))
    }
}

impl From<&str> for SharedText {
    fn from(text: &str) -> Self {
        SharedText(Arc::from(text))
    }
}

impl From<&String> for SharedText {
    fn from(text: &String) -> Self {
        SharedText(Arc::from(text.as_str()))
    }
}

impl PartialEq<str> for SharedText {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for SharedText {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Debug for SharedText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SharedText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_shares_the_text_and_hashes_as_the_str() {
        use std::hash::BuildHasher;
        let text = SharedText::from("order #W123 shipped".to_owned());
        let copy = text.clone();
        assert!(std::ptr::eq(text.as_str(), copy.as_str()));
        let hasher = foldhash::quality::FixedState::with_seed(7);
        assert_eq!(
            hasher.hash_one(&text),
            hasher.hash_one("order #W123 shipped")
        );
        assert_eq!(text, "order #W123 shipped");
        assert_eq!(format!("{text:?}"), "\"order #W123 shipped\"");
    }
}
