//! A field that can be absent, explicitly `null`, or set, so that a typed field round-trips
//! exactly as the client sent it (pydantic-based clients send `"tool_calls": null` and similar).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Use with `#[serde(default, skip_serializing_if = "Nullable::is_absent")]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Nullable<T> {
    #[default]
    Absent,
    Null,
    Value(T),
}

impl<T> Nullable<T> {
    pub fn is_absent(&self) -> bool {
        matches!(self, Nullable::Absent)
    }

    /// The value when one is set; `None` for both absent and `null`.
    pub fn get(&self) -> Option<&T> {
        match self {
            Nullable::Value(v) => Some(v),
            _ => None,
        }
    }

    pub fn get_mut(&mut self) -> Option<&mut T> {
        match self {
            Nullable::Value(v) => Some(v),
            _ => None,
        }
    }
}

impl<T> From<Option<T>> for Nullable<T> {
    fn from(value: Option<T>) -> Self {
        value.map_or(Nullable::Absent, Nullable::Value)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Nullable<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Only called when the key is present; `#[serde(default)]` covers absence.
        Ok(Option::<T>::deserialize(deserializer)?.map_or(Nullable::Null, Nullable::Value))
    }
}

impl<T: Serialize> Serialize for Nullable<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Nullable::Value(v) => v.serialize(serializer),
            Nullable::Absent | Nullable::Null => serializer.serialize_none(),
        }
    }
}
