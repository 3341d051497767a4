//! A tool's JSON Schema (`parameters`): shared by every copy of a request (`Arc`), never changed,
//! and hashed and serialized once. A request's tools are counted and keyed many times per
//! request (every earlier point of a conversation, every budget step), and walking each schema
//! for its hash was a tenth of a warm request's instructions; writing the schemas of the tools
//! sent was another twentieth. Its concise form (what the tools stage sends of a tool in full)
//! is made once too.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, OnceLock};

use foldhash::quality::FixedState;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// A JSON Schema, as the client wrote it, and its hash and compact JSON once computed.
#[derive(Debug, Clone, Default)]
pub struct Schema {
    value: Value,
    hash: OnceLock<u64>,
    json: OnceLock<Option<Box<RawValue>>>,
    /// The concise form, and the name of the function it was made for.
    concise: OnceLock<(String, Option<Arc<Schema>>)>,
}

const SCHEMA_SEED: u64 = 0x7363_6865_6d61_0001;

impl Schema {
    pub fn new(value: Value) -> Schema {
        Schema {
            value,
            hash: OnceLock::new(),
            json: OnceLock::new(),
            concise: OnceLock::new(),
        }
    }

    /// The concise form of this schema as the parameters of the function `name`
    /// (`pipeline::tools::concise`), made by `make` once for every request that shares this
    /// schema (made again, not kept, for another name); `None` when it is this schema.
    pub fn concise(
        &self,
        name: &str,
        make: impl Fn(&Value) -> Option<Value>,
    ) -> Option<Arc<Schema>> {
        let made = || make(&self.value).map(|value| Arc::new(Schema::new(value)));
        let (made_for, concise) = self.concise.get_or_init(|| (name.to_owned(), made()));
        if made_for == name {
            concise.clone()
        } else {
            made()
        }
    }

    /// The schema as compact JSON (what `serde_json::to_string` writes), written on first use.
    pub fn json(&self) -> Option<&str> {
        self.json
            .get_or_init(|| serde_json::value::to_raw_value(&self.value).ok())
            .as_deref()
            .map(RawValue::get)
    }

    pub fn value(&self) -> &Value {
        &self.value
    }

    /// A hash of every key, value and type of the schema, computed on first use.
    pub fn content_hash(&self) -> u64 {
        *self.hash.get_or_init(|| {
            let mut hasher = FixedState::with_seed(SCHEMA_SEED).build_hasher();
            hash_json(&self.value, &mut hasher);
            hasher.finish()
        })
    }
}

impl std::ops::Deref for Schema {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.value
    }
}

impl PartialEq for Schema {
    fn eq(&self, other: &Schema) -> bool {
        std::ptr::eq(self, other) || self.value == other.value
    }
}

impl Eq for Schema {}

impl Serialize for Schema {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self
            .json
            .get_or_init(|| serde_json::value::to_raw_value(&self.value).ok())
        {
            Some(json) => json.serialize(serializer),
            None => self.value.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Schema {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Schema, D::Error> {
        Value::deserialize(deserializer).map(Schema::new)
    }
}

/// Feeds every key, value and type of `value` to `hasher`.
pub fn hash_json(value: &Value, hasher: &mut impl Hasher) {
    match value {
        Value::Null => 0u8.hash(hasher),
        Value::Bool(b) => (1u8, b).hash(hasher),
        Value::Number(n) => (2u8, n.to_string()).hash(hasher),
        Value::String(s) => (3u8, s).hash(hasher),
        Value::Array(items) => {
            (4u8, items.len()).hash(hasher);
            items.iter().for_each(|v| hash_json(v, hasher));
        }
        Value::Object(map) => {
            (5u8, map.len()).hash(hasher);
            for (k, v) in map {
                k.hash(hasher);
                hash_json(v, hasher);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_schema_reads_and_writes_as_its_json_and_hashes_by_content() {
        let text = r#"{"type":"object","properties":{"id":{"type":"string","minimum":1.5}}}"#;
        let schema: Schema = serde_json::from_str(text).unwrap();
        assert_eq!(serde_json::to_string(&schema).unwrap(), text);
        assert_eq!(serde_json::to_string(&schema).unwrap(), text);
        assert_eq!(schema.json(), Some(text));
        assert_eq!(serde_json::to_value(&schema).unwrap(), *schema.value());
        let wrapped = serde_json::json!({"parameters": schema.clone()});
        assert_eq!(wrapped["parameters"], *schema.value());
        let same = Schema::new(
            json!({"type": "object", "properties": {"id": {"type": "string", "minimum": 1.5}}}),
        );
        assert_eq!(schema, same);
        assert_eq!(schema.content_hash(), same.content_hash());
        let other =
            Schema::new(json!({"type": "object", "properties": {"id": {"type": "integer"}}}));
        assert_ne!(schema.content_hash(), other.content_hash());
        assert_eq!(schema.clone().content_hash(), schema.content_hash());
    }
}
