"""What an SGLang launch with kvtier runs before and around its workers: the plugin SGLang
loads in every process, the launcher's checks, the model's identity, the CPU engine."""
