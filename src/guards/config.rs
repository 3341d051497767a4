//! `[continuation]`, `[reinforcement]`, `[action_check]`: global, and replaced whole by a
//! route's own table of the same name.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContinuationConfig {
    pub enabled: bool,
    /// Continuation requests per answer at most.
    pub max_attempts: u32,
    /// The user message that asks the model to go on.
    pub instruction: String,
}

impl Default for ContinuationConfig {
    fn default() -> Self {
        ContinuationConfig {
            enabled: false,
            max_attempts: 3,
            instruction: "Your previous message was cut off by the length limit. Continue \
                exactly where it stopped, from the next character: do not repeat anything, do \
                not add an introduction or a summary."
                .into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReinforcementConfig {
    pub enabled: bool,
    /// The reminder is added when the conversation has more than this many messages (system
    /// messages not counted).
    pub after_messages: usize,
    /// Added as the last section of the consolidated system message.
    pub text: String,
}

impl Default for ReinforcementConfig {
    fn default() -> Self {
        ReinforcementConfig {
            enabled: false,
            after_messages: 6,
            text: "Reminder: keep following the instructions above for the whole \
                conversation. When the user asks for an action, perform it by calling the \
                matching tool; never say an action is done unless a tool call did it."
                .into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActionCheckConfig {
    pub enabled: bool,
    /// Phrases that claim an action (any language; case, accents and punctuation ignored,
    /// matched as whole words).
    pub patterns: Vec<String>,
    /// Ask once more, with `retry_note`, and return that answer if it calls a tool.
    pub retry: bool,
    pub retry_note: String,
}

impl Default for ActionCheckConfig {
    fn default() -> Self {
        let patterns = [
            // English
            "i've created",
            "i have created",
            "i created",
            "i've updated",
            "i have updated",
            "i updated",
            "i've sent",
            "i have sent",
            "i've booked",
            "i have booked",
            "i've cancelled",
            "i've canceled",
            "i have cancelled",
            "i have canceled",
            "i've deleted",
            "i have deleted",
            "i've removed",
            "i've added",
            "i have added",
            "i've scheduled",
            "i've saved",
            "i've moved",
            "i've renamed",
            "i've changed",
            "i've modified",
            "has been created",
            "has been updated",
            "has been sent",
            "has been booked",
            "has been cancelled",
            "has been canceled",
            "has been deleted",
            "has been added",
            "has been scheduled",
            "has been saved",
            "successfully",
            "done",
            "all set",
            // Spanish
            "he creado",
            "he actualizado",
            "he enviado",
            "he reservado",
            "he cancelado",
            "he eliminado",
            "he borrado",
            "he agregado",
            "he añadido",
            "he guardado",
            "he movido",
            "he cambiado",
            "he modificado",
            "ha sido creado",
            "ha sido creada",
            "ha sido actualizado",
            "ha sido enviado",
            "ha sido cancelado",
            "ha sido cancelada",
            "ha sido eliminado",
            "con exito",
            "listo",
            "hecho",
        ];
        ActionCheckConfig {
            enabled: false,
            patterns: patterns.iter().map(|p| (*p).to_owned()).collect(),
            retry: false,
            retry_note: "Your last message says an action was done, but no tool was called, so \
                nothing was done. Perform the action now by calling the right tool."
                .into(),
        }
    }
}

/// The guards of one upstream: the route's tables where it has them, else the global ones.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Guards {
    pub continuation: ContinuationConfig,
    pub reinforcement: ReinforcementConfig,
    pub action_check: ActionCheckConfig,
}

impl Guards {
    pub fn validate(&self, key: &str) -> Result<(), (String, String)> {
        if self.continuation.enabled && self.continuation.max_attempts == 0 {
            return Err((
                format!("{key}continuation.max_attempts"),
                "must be at least 1".into(),
            ));
        }
        if self.continuation.enabled && self.continuation.instruction.trim().is_empty() {
            return Err((
                format!("{key}continuation.instruction"),
                "must not be empty".into(),
            ));
        }
        if self.reinforcement.enabled && self.reinforcement.text.trim().is_empty() {
            return Err((
                format!("{key}reinforcement.text"),
                "must not be empty".into(),
            ));
        }
        let check = &self.action_check;
        if check.enabled && check.patterns.iter().all(|p| p.trim().is_empty()) {
            return Err((
                format!("{key}action_check.patterns"),
                "list at least one phrase".into(),
            ));
        }
        if check.retry && check.retry_note.trim().is_empty() {
            return Err((
                format!("{key}action_check.retry_note"),
                "must not be empty".into(),
            ));
        }
        Ok(())
    }
}
