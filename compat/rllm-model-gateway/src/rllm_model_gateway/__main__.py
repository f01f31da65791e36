"""Allow ``python -m rllm_model_gateway``."""

if __name__ == "__main__":
    from rllm_model_gateway.server import main

    main()
