//! Error type shared by every store operation.

/// Everything that can go wrong in the store; callers map variants to API status codes.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database driver failed (I/O, locking, SQL error not covered below).
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),

    /// A row with the same unique key already exists.
    #[error("conflict: {0}")]
    Conflict(String),

    /// An agent runtime already has an active (not yet finished) run; a second start is
    /// refused until it ends. Callers answer it like a conflict (HTTP 409).
    #[error("agent runtime {runtime_id} already has an active run {run_id}")]
    ActiveRun {
        /// The runtime that was asked for a second run.
        runtime_id: String,
        /// Its run that is still active.
        run_id: String,
    },

    /// The row an update targeted does not exist.
    #[error("not found: {0}")]
    NotFound(String),

    /// A role name that is not a lowercase word.
    #[error("invalid role name {0:?}")]
    InvalidRole(String),

    /// A pagination cursor was not one this store handed out.
    #[error("invalid pagination cursor")]
    InvalidCursor,

    /// A stored row could not be decoded (unknown state, malformed JSON column).
    #[error("corrupt stored data: {0}")]
    Corrupt(String),

    /// A value could not be encoded as JSON for storage.
    #[error("encoding error: {0}")]
    Encode(#[from] serde_json::Error),

    /// The database was written by a newer build; refusing to touch it avoids silent damage.
    #[error("database schema version {found} is newer than the supported version {supported}")]
    SchemaTooNew {
        /// Version recorded in the database.
        found: i64,
        /// Highest version this build knows.
        supported: i64,
    },

    /// The operating system's random number source failed.
    #[error("randomness unavailable: {0}")]
    Random(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        // Unique violations are an expected outcome callers act on (HTTP 409), so they get
        // their own variant instead of hiding inside a generic driver error.
        if let sqlx::Error::Database(db) = &err
            && db.is_unique_violation()
        {
            return StoreError::Conflict(db.message().to_string());
        }
        StoreError::Database(err)
    }
}
