"""spanrl record schemas (Avro) and topic declarations. See schemas/README.md."""
from spanrl.schemas.codec import SchemaError, decode, encode, latest_version
from spanrl.schemas import topics

__all__ = ["SchemaError", "decode", "encode", "latest_version", "topics"]
