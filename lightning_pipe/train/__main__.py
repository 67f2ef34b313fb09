from lightning_pipe.train.app import main

if __name__ == "__main__":
    main()
